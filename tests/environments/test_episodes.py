"""Multi-turn generation with an environment on the real HF engine: replies inserted token-in/token-out with no
loss, turn limits, the environment's rewards as a reward term, its stop reasons and metrics, a broken one as
one line, and the documented example (docs/examples/my_environment.py).

The mask the episodes make (`Episode.add_tokens` → `Completion.sampled_mask` → `RolloutTensors.sampled_mask`) is
followed to the loss at the end: the trained ids are exactly the sampled ids with the inserted ids between them,
and the inserted tokens get exactly zero gradient, no KL and no normaliser count, through the real loss path of
each kind of loss."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import pytest
import torch

from rlvr_lightning.algos import GRPO, REAL
from rlvr_lightning.environments.base import Environment, EnvironmentFailed, Reply
from rlvr_lightning.environments.episodes import episode_metrics, generate_episodes
from rlvr_lightning.training.batch import optimizer_step_norms
from tests.support.char_tokenizer import Chars
from tests.support.cli import REPO
from tests.support.update_harness import G, attach, gradient, prepared, sample_rollout

NOTE = "\nnote\n"


class Nudge(Environment):
    """Replies NOTE after each segment; ends on the third with reward = the episode's sampled token count."""

    max_turns = 5
    stop_reasons = ("done",)

    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []
        self.replies = 0

    def reply(self, episodes):
        time.sleep(0.02)  # a reply takes time: the batch's environment_seconds counts it once per reply
        self.replies += 1
        self.seen += [(e.turns, e.segment) for e in episodes]
        return [Reply(stop="done", reward=float(len(e.own_ids))) if e.turns == 3 else Reply(NOTE) for e in episodes]

    def metrics(self, episodes):
        return {"nudge_episodes": float(len(episodes))}


@pytest.fixture(scope="module")
def generation(quick_warm_start):
    """The warm start's data module and HF engine (it ends its answers: an untrained policy seldom samples EOS),
    and a function sampling a batch of 2 prompts × 2 in `env`."""
    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.evaluate import model_engine
    from rlvr_lightning.rollout.settings import RolloutSettings

    dm = RolloutDataModule(model_name_or_path=str(quick_warm_start[1]), batch_size=2, val_data=None,
                           rollout=RolloutSettings(engine="hf", max_response_length=40))  # fmt: skip
    dm.setup("fit")
    engine = model_engine(dm)
    batch = dm.collate(dm.train_records[:2])
    prompts = [dm.tokenizer(p, add_special_tokens=False).input_ids for p in batch.prompts]

    def run(env, max_tokens=40):
        sampling = dm.rollout.sampling(group_size=2, seed=0, max_tokens=max_tokens)
        return generate_episodes(engine, dm.tokenizer, prompts, sampling, env, batch)

    yield dm, engine, batch, run
    engine.close()


def test_replies_are_inserted_between_the_sampled_segments_with_no_loss(generation):
    dm, _, batch, run = generation
    env = Nudge()
    episodes = [e for group in run(env, max_tokens=200) for e in group]
    note = dm.tokenizer(NOTE, add_special_tokens=False).input_ids
    assert all(e.question == batch.prompts[i // 2] and e.answer == batch.answers[i // 2] for i, e in enumerate(episodes))
    for e in episodes:
        assert e.stop in ("done", "length")
        if e.stop == "done":  # three segments with the note's ids between them, its tokens marked inserted
            assert e.turns == 3 and e.reward == len(e.own_ids)
            inserted = [i for i, s in enumerate(e.sampled_mask) if not s]
            assert len(inserted) == 2 * len(note)
            assert [e.ids[i] for i in inserted] == note + note
            assert all(e.logprobs[i] == 0.0 for i in inserted)
            c = e.completion()
            assert c.token_ids == e.ids and c.sampled_mask == e.sampled_mask and c.num_sampled == len(e.own_ids)
    assert any(e.stop == "done" for e in episodes), [e.stop for e in episodes]
    # the environment read the model's own segment text each turn
    assert {t for t, _ in env.seen} <= {1, 2, 3} and all(NOTE not in text for _, text in env.seen)
    metrics = episode_metrics(episodes, env)
    assert metrics["stop_done_frac"] + metrics["stop_length_frac"] == 1.0 and metrics["stop_answered_frac"] == 0.0
    assert metrics["nudge_episodes"] == 4.0 and 0 < metrics["inserted_token_frac"] < 1
    assert 0.02 * env.replies <= metrics["environment_seconds"] < 0.02 * env.replies + 1.0
    assert metrics["reward_environment_mean"] == pytest.approx(sum(e.reward or 0.0 for e in episodes) / 4)


def test_max_turns_and_the_budget_end_an_episode_the_environment_would_continue(generation):
    _, _, _, run = generation

    class Forever(Environment):
        max_turns = 2

        def reply(self, episodes):
            return [Reply(NOTE) for _ in episodes]

    episodes = [e for group in run(Forever(), max_tokens=200) for e in group]
    assert all(e.turns <= 2 and e.stop in ("max_turns", "length") for e in episodes)
    assert all(e.reward is None for e in episodes)
    short = [e for group in run(Forever(), max_tokens=12) for e in group]
    assert all(len(e.ids) <= 12 for e in short)


def test_the_environments_rewards_are_a_reward_term_of_the_rollout(generation):
    from rlvr_lightning.training.generation import sample

    dm, engine, batch, _ = generation
    rollout = sample(engine, dm.tokenizer, batch, dm.rollout.sampling(group_size=2, seed=0, max_tokens=200), 0, Nudge())
    rewards = rollout.reward_terms["environment"]
    assert rewards.shape == (4,) and rollout.own_texts and rollout.metrics["nudge_episodes"] == 4.0
    ended = torch.tensor([c.finish_reason != "length" for c in rollout.completions])
    assert torch.all(rewards[~ended] == 0) and torch.all(rewards[ended] > 0)
    assert torch.equal(rollout.reward_with_terms(torch.zeros(4)), rewards)


@pytest.mark.parametrize(
    "reply, message",
    [
        (lambda episodes: 1 / 0, "data.environment: Broken.reply raised ZeroDivisionError: division by zero"),
        (lambda episodes: [Reply()], "data.environment: Broken.reply must return one Reply per episode (4)"),
        (lambda episodes: ["text"] * len(episodes), "data.environment: Broken.reply must return one Reply per episode"),
    ],
)
def test_a_broken_environment_is_one_line(generation, reply, message):
    _, _, _, run = generation

    class Broken(Environment):
        def reply(self, episodes):
            return reply(episodes)

    with pytest.raises(EnvironmentFailed) as info:
        run(Broken())
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_documented_environment_gives_a_second_try_and_its_reward(generation, monkeypatch):
    """docs/examples/my_environment.py: an episode that ends in time either answered right at once (reward 1)
    or had the hint after its first answer and a second try (reward 0.5 if right, else 0)."""
    monkeypatch.syspath_prepend(str(REPO / "docs" / "examples"))
    monkeypatch.delitem(sys.modules, "my_environment", raising=False)
    from my_environment import SecondChance

    dm, _, _, run = generation
    env = SecondChance()
    episodes = [e for group in run(env, max_tokens=200) for e in group]
    hint = dm.tokenizer(env.hint, add_special_tokens=False).input_ids
    for e in episodes:
        if e.stop == "length":
            continue
        assert e.stop == "answered"
        if e.turns == 1:
            assert e.reward == 1.0 and all(e.sampled_mask)
        else:
            assert e.turns == 2 and e.reward in (0.0, 0.5)
            assert [t for t, s in zip(e.ids, e.sampled_mask) if not s] == hint
    assert any(e.turns == 2 and e.stop == "answered" for e in episodes), [(e.turns, e.stop) for e in episodes]


def test_make_list_shows_the_built_in_environment_and_a_users(monkeypatch, capsys):
    from rlvr_lightning.catalogue import main

    monkeypatch.syspath_prepend(str(REPO / "docs" / "examples"))
    monkeypatch.delitem(sys.modules, "my_environment", raising=False)
    main(["--imports", "my_environment"])
    out = capsys.readouterr().out
    text = " ".join(out.split())  # wrapped lines joined
    assert "(none) one segment per answer" in text
    assert "PythonTool The Python tool of tool-integrated reasoning: " in text and "answer. (--data.tool.*)" in text
    assert "SecondChance A wrong first answer is told so and may try once more; a right first answer earns the most. " \
           "(--data.environment my_environment.SecondChance)" in text


class Digits(Environment):
    """Ends a segment at any digit and replies with another, twice: where a BPE tokenizer merges digits, the reply's
    text joins the model's last token into strings a fresh encoding splits otherwise."""

    max_turns = 3
    stop = tuple("0123456789")

    def reply(self, episodes):
        return [Reply("5") if e.turns < self.max_turns else Reply(stop="answered") for e in episodes]


@pytest.fixture(scope="module")
def bpe_policy_dir(tmp_path_factory):
    """A random tiny Qwen2 with a byte-level BPE tokenizer that has merges (digit pairs among them), unlike the
    embedded tokenizer's one token per byte, for which decoding and encoding again gives back the same ids."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rlvr_lightning.models.embedded import EOS, PAD, UNK, TinyQwen2Spec, build_tiny_qwen2, save_policy

    rng = random.Random(0)
    corpus = [f"What is {rng.randint(0, 999)}*{rng.randint(0, 999)}? {rng.randint(0, 10**6)}" for _ in range(4000)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[PAD, EOS, UNK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    core.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left")
    assert len(tok("12345").input_ids) < 5  # it merges
    return save_policy(build_tiny_qwen2(tok, TinyQwen2Spec(num_hidden_layers=2), seed=0), tok, tmp_path_factory.mktemp("bpe"))


def test_a_bpe_tokenizers_episodes_keep_the_engines_ids_where_encoding_the_text_again_would_not(bpe_policy_dir):
    """Token-in/token-out where it matters: with merges, the text of sampled ids and a reply encodes to other ids,
    yet every episode's ids are its sampled segments with the reply's own encoding between them, and the trainer's
    log-probs of those ids equal the engine's on every sampled token (the HF engine)."""
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.evaluate import model_engine
    from rlvr_lightning.models.forward import sequence_logprobs
    from rlvr_lightning.rollout.settings import RolloutSettings

    dm = RolloutDataModule(model_name_or_path=str(bpe_policy_dir), batch_size=2, val_data=None,
                           rollout=RolloutSettings(engine="hf", max_response_length=32))  # fmt: skip
    dm.setup("fit")
    tok, engine = dm.tokenizer, model_engine(dm)
    batch = dm.collate(dm.train_records[:2])
    prompts = [tok(p, add_special_tokens=False).input_ids for p in batch.prompts]
    try:
        groups = generate_episodes(engine, tok, prompts, dm.rollout.sampling(group_size=4, seed=0), Digits(), batch)
    finally:
        engine.close()
    episodes = [e for group in groups for e in group]
    five = tok("5", add_special_tokens=False).input_ids
    replied = [e for e in episodes if not all(e.sampled_mask)]
    assert len(replied) >= 4, [e.stop for e in episodes]
    policy = AutoModelForCausalLM.from_pretrained(bpe_policy_dir, dtype=torch.float32)
    for e in replied:
        inserted = [i for i, s in enumerate(e.sampled_mask) if not s]
        assert [e.ids[i] for i in inserted] == five * (len(inserted) // len(five)) and inserted
        trainer = sequence_logprobs(policy, e.prompt, e.ids)
        assert max(abs(trainer[i] - e.logprobs[i]) for i, s in enumerate(e.sampled_mask) if s) < 1e-4
    # what keeping the ids prevents: the same text, encoded again, is other ids
    assert any(tok(tok.decode(e.ids), add_special_tokens=False).input_ids != e.ids for e in replied)


class Pieces(Environment):
    """Ends a segment at a boxed answer's opening and replies NOTE; records the turns it saw, and whether a stop string's characters
    were sampled in two pieces (two versions)."""

    stop = ("\\boxed{",)
    max_turns = 6

    def __init__(self) -> None:
        self.seen: dict[int, list[str]] = {}
        self.split_stops = 0

    def reply(self, episodes):
        for e in episodes:
            self.seen.setdefault(id(e), []).append(e.segment)
            if e.stopped_at is not None and len(set(e.versions[-len(e.stopped_at) :])) > 1:
                self.split_stops += 1
        return [Reply(NOTE) for _ in episodes]


def test_episodes_advanced_in_pieces_take_whole_turns_across_the_caps(generation):
    """The rollout stream's partial rollouts in an environment: advanced to a cap every 3 tokens, under a new
    version each time, every episode stops at each cap and goes on from there; the environment sees each turn once
    and whole, its stop string found even where two pieces sampled its characters, and each token keeps the version
    that sampled it."""
    from rlvr_lightning.environments.episodes import advance_episodes, start_episodes

    dm, engine, batch, _ = generation
    tok = dm.tokenizer
    prompts = [tok(p, add_special_tokens=False).input_ids for p in batch.prompts]
    sampling = dm.rollout.sampling(group_size=2, seed=0, max_tokens=60)
    env = Pieces()
    episodes = start_episodes(prompts, 2, batch)
    for version, cap in enumerate(range(3, 61, 3)):
        advance_episodes(engine.generate, tok, episodes, sampling, env, cap, version)
        assert all(len(e.ids) >= cap for e in episodes if e.stop is None)
        assert all(len(e.versions) == len(e.ids) and e.versions == sorted(e.versions) for e in episodes)
    assert all(e.stop is not None for e in episodes)
    note = tok(NOTE, add_special_tokens=False).input_ids
    for e in episodes:
        segments = env.seen[id(e)]
        assert len(segments) == e.turns and "".join(segments) == tok.decode(e.own_ids)
        for text in segments:  # cut at its stop string, across pieces too
            assert text.count("\\boxed{") == text.endswith("\\boxed{"), text
        inserted = [t for t, s in zip(e.ids, e.sampled_mask) if not s]
        assert inserted == (note * e.turns)[: len(inserted)] and len(inserted) >= len(note) * (e.turns - 1)
    assert env.split_stops > 0 and sum(len(s) for s in env.seen.values()) > len(episodes)  # the paths ran


def test_an_episode_in_flight_survives_a_checkpoint_loaded_weights_only(tmp_path):
    """A batch generated ahead goes into the checkpoint with its episodes as plain values, loadable the way
    LightningCLI loads one, and the Python tool rebuilds its calls; what happened so far (its trace's events) too."""
    from rlvr_lightning.environments.episodes import Episode, plain_value
    from rlvr_lightning.environments.python_tool import PythonTool, ToolCall
    from rlvr_lightning.sandbox import Execution

    call = ToolCall("print(6*7)", Execution("42\n", "", "ok", 0, 0.01), "```output\n42\n```\n", False, (10, 13))
    events = [{"kind": "turn", "tokens": [0, 1], "ns": [1, 2], "stopped_at": "```"},
              {"kind": "reply", "tokens": [1, 2], "ns": [3, 4], "stop": None, "reward": None, "calls": [plain_value(call)]}]  # fmt: skip
    e = Episode([1, 2], "q", "42", [5, 6, 7], [-0.5, 0.0, -0.1], [True, False, True], [0, 0, 1], turns=1, turn_start=2,
                segment="x", calls=[call], state={"void_turns": 1}, events=events, turn_started_ns=5)  # fmt: skip
    torch.save({"episodes": [e.to_state()]}, tmp_path / "ckpt")
    (saved,) = torch.load(tmp_path / "ckpt", weights_only=True)["episodes"]
    assert Episode.from_state(saved, PythonTool()) == e
    assert Episode.from_state(saved, PythonTool()).completion().events == events


def test_a_batchs_episode_metrics_have_the_same_keys_whatever_its_episodes_did():
    """Ranks sum the held-out evaluation's episode metrics key by key (FSDP): a rank whose episodes got no reward,
    stopped for no reason of the environment's or took no turn must still give every key."""
    from rlvr_lightning.environments.episodes import Episode

    env = Nudge()
    rewarded = [Episode([1], ids=[2, 3], sampled_mask=[True, False], turns=3, stop="done", reward=2.0)]
    plain = [Episode([1], ids=[2], sampled_mask=[True], turns=1, stop="length")]
    assert episode_metrics(rewarded, env).keys() == episode_metrics(plain, env).keys()
    assert episode_metrics(plain, env)["reward_environment_mean"] == 0.0


# ---- the mask to the loss: inserted tokens are context only ---------------------------------------------
# Per completion of `sample_rollout` (lengths 2, 8, 5, 8, 3, 6, 8, 4): which response tokens an environment
# inserted (0), the rest sampled (1). Rows 2 and 7 are untouched.
SAMPLED = {1: [1, 1, 0, 0, 0, 1, 1, 1], 3: [1, 0, 1, 1, 0, 0, 1, 1], 4: [1, 0, 1], 5: [0, 1, 1, 1, 0, 1], 6: [1, 1, 1, 1, 1, 1, 0, 0]}


def with_inserted_tokens(rollout):
    completions = list(rollout.completions)
    for n, sampled in SAMPLED.items():
        c = completions[n]
        assert len(sampled) == len(c.token_ids)
        logprobs = [lp if s else 0.0 for lp, s in zip(c.logprobs, sampled)]  # an inserted token has no engine log-prob
        completions[n] = replace(c, logprobs=logprobs, sampled_mask=[bool(s) for s in sampled])
    return replace(rollout, completions=completions)


def test_the_trained_ids_are_the_sampled_and_inserted_ids_in_order_and_only_sampled_ones_are_trained(tiny_policy_dir):
    module = attach(GRPO, tiny_policy_dir)
    rollout = with_inserted_tokens(sample_rollout(module))
    t = rollout.tensors(pad_id=0)
    for n, c in enumerate(rollout.completions):
        L = len(c.token_ids)
        assert t.input_ids[n, t.prompt_width : t.prompt_width + L].tolist() == c.token_ids
        expected = torch.tensor(SAMPLED.get(n, [1] * L), dtype=torch.float32)
        assert torch.equal(t.sampled_mask[n, :L], expected) and t.sampled_mask[n, L:].sum() == 0
        assert torch.equal(t.response_mask[n, :L], torch.ones(L))  # present (attended to) all the same
    assert torch.equal(t.trimmed().sampled_mask, t.sampled_mask[:, : t.trimmed().response_mask.shape[1]])
    plain = sample_rollout(module).tensors(pad_id=0)  # nothing inserted: the mask is there all the same
    assert torch.equal(plain.sampled_mask, plain.response_mask)


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (GRPO, {}),  # per-token clipped loss, seq-mean-token-mean
        (GRPO, {"policy_loss": "gspo", "loss_agg": "seq-mean-token-mean"}),  # one ratio per sequence
        (GRPO, {"loss_agg": "seq-mean-token-sum", "kl_estimator": "k3", "kl_coef": 0.1,
                "policy_loss": {"name": "ppo-clip", "knobs": {"dual_clip_c": 3.0}}}),  # KL
        (REAL, {"num_mini_batches": 1}),  # group-level loss over sequence log-ratios
    ],
    ids=["grpo", "gspo", "kl", "real"],
)
def test_inserted_tokens_get_exactly_zero_gradient_through_the_real_update(tiny_policy_dir, cls, kwargs):
    """The LM head's input at the position that predicts an inserted token gets exactly zero gradient (nothing
    of the loss reads that token's log-prob), while the positions that predict sampled tokens do get one."""
    module = attach(cls, tiny_policy_dir, **kwargs)
    rollout = with_inserted_tokens(sample_rollout(module))
    inputs = prepared(module, rollout)
    for n, sampled in SAMPLED.items():  # nothing inserted enters the loss
        assert torch.equal(inputs.loss_mask[n, : len(sampled)], torch.tensor(sampled, dtype=torch.float32))
    norms = optimizer_step_norms(inputs, torch.arange(2 * G), module.step_context().collectives, 1.0)
    assert norms.num_tokens == 44 - 11  # the token normaliser counts the 33 sampled tokens of the 44
    head_inputs = []

    def keep_grad(_module, args):
        args[0].retain_grad()
        head_inputs.append(args[0])

    hook = module.policy.get_output_embeddings().register_forward_pre_hook(keep_grad)
    try:
        gradient(module, inputs, micro_batch_size=2 * G)
    finally:
        hook.remove()
    (hidden,) = [h for h in head_inputs if h.grad is not None]  # [N, T+1, d]: column j predicts response token j
    per_token = hidden.grad[:, :-1].abs().sum(-1)
    T = per_token.shape[1]
    inserted = (inputs.tensors.response_mask - inputs.tensors.sampled_mask)[:, :T].bool()
    assert inserted.sum() == sum(s.count(0) for s in SAMPLED.values())
    assert torch.all(per_token[inserted] == 0)  # exactly
    trained = inputs.loss_mask[:, :T].bool()
    assert (per_token[trained] > 0).float().mean() > 0.5  # the sampled tokens are trained


def test_the_loop_marks_each_token_as_it_appends_it_and_keeps_what_the_environment_returns():
    """Segments are marked sampled and replies inserted as the loop appends them, in one mask the completion
    carries on; a reply's calls and notes are kept by the loop, for the episode that ends too."""
    from rlvr_lightning.environments.episodes import advance_episodes, start_episodes
    from rlvr_lightning.rollout.types import Completion, SamplingConfig

    segments = iter(["ab!", "cd!", "e"])

    def generate(prompts, sampling):
        ids = [[ord(c) for c in next(segments)] for _ in prompts]
        return [[Completion(i, [-0.5] * len(i), "stop")] for i in ids]

    class Notes(Environment):
        stop = ("!",)

        def reply(self, episodes):
            (e,) = episodes
            turn = {"calls": (f"call {e.turns}",), "notes": {"last": e.turns, f"turn {e.turns}": e.segment}}
            return [Reply("XY", **turn) if e.turns < 3 else Reply(None, "answered", reward=1.0, **turn)]

    (episode,) = start_episodes([[1]], 1)
    advance_episodes(generate, Chars(), [episode], SamplingConfig(group_size=1, max_tokens=40), Notes())
    assert Chars().decode(episode.ids) == "ab!XYcd!XYe" and episode.stop == "answered" and episode.reward == 1.0
    assert episode.sampled_mask == [True] * 3 + [False] * 2 + [True] * 3 + [False] * 2 + [True]
    assert episode.logprobs == [-0.5] * 3 + [0.0] * 2 + [-0.5] * 3 + [0.0] * 2 + [-0.5]
    assert episode.calls == ["call 1", "call 2", "call 3"]
    assert episode.state == {"last": 3, "turn 1": "ab!", "turn 2": "cd!", "turn 3": "e"}
    c = episode.completion()
    assert c.sampled_mask == episode.sampled_mask and c.num_sampled == 7 and c.sampled_mask is not episode.sampled_mask
    # what happened, in order, for the answer's trace: each turn and each reply with its token range and calls
    assert [(e["kind"], e["tokens"]) for e in c.events] == [("turn", [0, 3]), ("reply", [3, 5]), ("turn", [5, 8]),
                                                           ("reply", [8, 10]), ("turn", [10, 11]), ("reply", [11, 11])]  # fmt: skip
    assert [e["calls"] for e in c.events if e["kind"] == "reply"] == [["call 1"], ["call 2"], ["call 3"]]
    assert [e["stop"] for e in c.events if e["kind"] == "reply"] == [None, None, "answered"]
    assert [e["stopped_at"] for e in c.events if e["kind"] == "turn"] == ["!", "!", None]
    times = [t for e in c.events for t in e["ns"]]
    assert all(0 < t for t in times) and all(e["ns"][0] <= e["ns"][1] for e in c.events)
    assert c == replace(c, events=[])  # wall-clock times: not part of a completion's value


def test_a_turn_cut_by_a_partial_rollouts_cap_is_one_turn_from_its_first_piece():
    """A turn sampled in two pieces (a weight sync between them) is one turn in the answer's events, spanning
    the first piece's generation call to the one that ended it."""
    from rlvr_lightning.environments.episodes import advance_episodes, start_episodes
    from rlvr_lightning.rollout.types import Completion, SamplingConfig

    pieces = iter(["abc", "d!", "e"])

    def generate(prompts, sampling):
        text = next(pieces)[: sampling.max_tokens]
        time.sleep(0.002)  # the calls' windows apart
        return [[Completion([ord(c) for c in text], [-0.5] * len(text), "length" if len(text) == 3 else "stop")]]

    class Echo(Environment):
        stop = ("!",)

        def reply(self, episodes):
            return [Reply("X") if e.turns < 2 else Reply(None) for e in episodes]

    (episode,) = start_episodes([[1]], 1)
    sampling = SamplingConfig(group_size=1, max_tokens=40)
    advance_episodes(generate, Chars(), [episode], sampling, Echo(), cap=3)  # "abc": stopped at the cap mid-turn
    assert episode.events == [] and Chars().decode(episode.ids) == "abc"
    first_call = episode.turn_started_ns
    advance_episodes(generate, Chars(), [episode], sampling, Echo())
    assert Chars().decode(episode.ids) == "abcd!Xe"
    turns = [e for e in episode.events if e["kind"] == "turn"]
    assert [e["tokens"] for e in turns] == [[0, 5], [6, 7]]
    assert turns[0]["ns"][0] == first_call < turns[0]["ns"][1] < turns[1]["ns"][0]
