"""Offline evaluation of a policy (an HF model directory, e.g. an `HFExport`, a LoRA adapter directory, a Lightning `.ckpt`, or
`embedded`) on one or more benchmarks with vLLM, recorded as an MLflow run: `eval/<bench>/accuracy`,
`pass_at_<k>`, `maj_at_<k>` (with `_se` standard errors), `accuracy_greedy`, the sampling settings as
params (`eval/<bench>/temperature`, …), and a samples table per benchmark. The scoring is the
in-training `Evaluation` callback's own (each --bench is one of its `benchmarks`): correctness from math-verify
against the gold, or from `--correctness` (`environment`, or `module.function`), as a run's `rewards.correctness`.

    python -m rlvr_lightning.evaluate --model exports/<run>/final --bench path/to/math500.jsonl
    make eval CKPT=exports/<run>/final BENCH="embedded path/to/gsm8k.jsonl"

A benchmark is `embedded` (the built-in task's test split), a .jsonl/.json/.parquet file, or an HF
dataset name; fields are auto-detected or given with --problem-field / --answer-field.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path


def bench_name(source: str) -> str:
    return Path(source).stem if Path(source).suffix else source.replace("/", "_")


def evaluate(args: argparse.Namespace) -> dict[str, float]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from lightning.pytorch.loggers import MLFlowLogger

    from rlvr_lightning.callbacks.evaluation import Benchmark, EvalTarget, Evaluation
    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.errors import ConfigError
    from rlvr_lightning.models.checkpoint import is_lightning_checkpoint, policy_from_checkpoint
    from rlvr_lightning.models.lora import is_adapter_dir, read_adapter
    from rlvr_lightning.rewards.settings import ENVIRONMENT, RewardSettings, VerifierSettings
    from rlvr_lightning.rollout.settings import RolloutSettings
    from rlvr_lightning.training.generation import sample
    from rlvr_lightning.training.scoring import Scoring

    names = [bench_name(s) for s in args.bench]
    if len(set(names)) < len(names):
        raise ConfigError(f"--bench: two benchmarks share a name ({names}); give each file a distinct stem")
    if args.correctness == ENVIRONMENT and not (args.environment or args.tool_max_calls):
        raise ConfigError("--correctness environment: the answers need an environment to judge them (--environment or --tool-max-calls)")
    scoring = Scoring(RewardSettings(args.correctness, verifier=VerifierSettings(num_workers=args.verifier_workers)))
    model, adapter = args.model, None
    if is_lightning_checkpoint(model):  # a training checkpoint: its policy, as an HF directory beside it
        model = str(policy_from_checkpoint(model))
    elif is_adapter_dir(model):  # a LoRA export: its base model, served with the adapter (vLLM's LoRA path)
        adapter = read_adapter(model)
        model = adapter.base_model
    if args.max_prompt_length is None:
        from transformers import AutoConfig

        from rlvr_lightning.models.warm_start import resolve_policy_path

        context = getattr(AutoConfig.from_pretrained(resolve_policy_path(model)), "max_position_embeddings", 4096)
        args.max_prompt_length = max(1, int(context) - args.max_tokens)
    # The data module holds the prompt template, the tokenizer and the engine's settings; its own
    # train/val sets are not used.
    rollout = RolloutSettings(
        max_response_length=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        engine=args.engine,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
    )
    dm = RolloutDataModule(
        model_name_or_path=model,
        train_data=args.bench[0],
        val_data=None,
        train_split=args.split,
        batch_size=1,
        problem_field=args.problem_field,
        answer_field=args.answer_field,
        prompt_template=args.prompt_template,
        use_chat_template=args.use_chat_template,
        max_prompt_length=args.max_prompt_length,
        seed=args.seed,
        rollout=rollout,
    )
    dm.setup("validate")
    benchmarks = [
        Benchmark(
            name=name,
            source=source,
            split=args.split,
            problem_field=args.problem_field,
            answer_field=args.answer_field,
            limit=args.limit,
        )
        for name, source in zip(names, args.bench)
    ]
    evaluation = Evaluation(
        every_n_steps=0,
        num_samples=args.n,
        temperature=args.temperature,
        greedy=not args.no_greedy,
        pass_k=args.k,
        maj_k=[k for k in args.k if k > 1],
        prefix="eval",
        benchmarks=benchmarks,
    )
    logger = MLFlowLogger(
        experiment_name=args.experiment,
        tracking_uri=args.tracking_uri,
        run_name=args.run_name,
        tags={"kind": "evaluation", "model": args.model},
    )
    environment = eval_environment(args)
    engine = model_engine(dm, adapter)
    try:
        generate = partial(sample, engine, dm.tokenizer, policy_version=0, environment=environment)
        results = evaluation.run(EvalTarget(generate, dm, scoring, logger), step=0)
    finally:
        engine.close()
        scoring.close()
        if environment is not None:
            environment.close()
    logger.finalize("success")
    for key, value in sorted(results.items()):
        print(f"{key:45s} {value:.4f}")
    print(f"MLflow run {logger.run_id} in {args.tracking_uri}")
    return results


def eval_environment(args: argparse.Namespace):
    """The environment the answers are sampled in: the Python tool (`--tool-max-calls`), one's own
    (`--environment my_module.Class`, built with its defaults), or None."""
    from rlvr_lightning.environments.base import Environment
    from rlvr_lightning.environments.python_tool import PythonToolSettings, environment_of
    from rlvr_lightning.errors import ConfigError
    from rlvr_lightning.rewards.loading import load_function

    tool = PythonToolSettings(max_calls=args.tool_max_calls) if args.tool_max_calls else None
    own = None
    if args.environment:
        cls = load_function(args.environment, who="--environment")
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ConfigError(f"--environment: {args.environment!r} is not a subclass of rlvr_lightning.environments.base.Environment")
        own = cls()
    return environment_of(tool, own, ("--tool-max-calls", "--environment"))


def model_engine(dm, adapter=None):
    """The engine that samples the evaluated model on this machine (one rank), without a training module: vLLM
    loads the model from its files and serves `adapter` (a `SavedAdapter`) through its LoRA path; the HF
    engine samples with the model loaded here, the adapter in place."""
    from rlvr_lightning.models.forward import sequence_logprobs
    from rlvr_lightning.models.lora import load_adapter_weights
    from rlvr_lightning.models.policy import load_policies
    from rlvr_lightning.rollout.settings import EngineSite

    lora = None if adapter is None else adapter.settings
    site = EngineSite(
        dm.policy_path,
        dm.max_model_len(),
        dm.hparams.seed,
        tokenizer=dm.tokenizer,
        lora_max_rank=None if lora is None else lora.engine_max_rank,
    )
    if dm.rollout.engine == "hf":
        policy, _ = load_policies(dm.policy_path, with_reference=False, lora=lora)
        if adapter is not None:
            load_adapter_weights(policy, adapter.tensors)
        return dm.rollout.build_engine(replace(site, policy=policy, policy_logprobs=partial(sequence_logprobs, policy)))
    engine = dm.rollout.build_engine(site)
    if adapter is not None:
        engine.load_adapter(adapter.tensors.items(), adapter.config, version=0)
    return engine


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded", help="HF model directory or id, a LoRA adapter directory, a Lightning .ckpt, or `embedded`")
    p.add_argument("--bench", nargs="+", default=["embedded"], help="benchmark files, HF dataset names or `embedded`")
    p.add_argument("--split", default="test")
    p.add_argument("--problem-field")
    p.add_argument("--answer-field")
    p.add_argument("--prompt-template", default="{problem}")
    p.add_argument("--use-chat-template", action="store_true")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark whose prompt fits")
    p.add_argument("--n", type=int, default=8, help="samples per problem")
    p.add_argument("--k", type=int, nargs="+", default=[1, 4, 8], help="k of pass@k (and maj@k for k > 1)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument(
        "--max-prompt-length",
        type=int,
        default=None,
        help="longer prompts are dropped (default: the model's context minus --max-tokens)",
    )
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    p.add_argument(
        "--tool-max-calls", type=int, default=0, help="answers may call the Python tool this often (0: no tool; docs/tools.md)"
    )
    p.add_argument(
        "--environment", help="answers in an environment of one's own: module.Class, built with its defaults (docs/environments.md)"
    )
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument(
        "--correctness", default="math-verify",
        help="where correctness comes from, as a run's rewards.correctness: math-verify (against the gold), environment, or module.function",
    )  # fmt: skip
    p.add_argument("--verifier-workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    p.add_argument("--experiment", default="rlvr_lightning")
    p.add_argument("--run-name", default="eval")
    from rlvr_lightning.errors import ConfigError

    try:
        evaluate(p.parse_args(argv))
    except ConfigError as err:  # a bad option: one line, as the training CLI's
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from rlvr_lightning.console import quiet_libraries

    main(quiet_libraries(sys.argv[1:]))  # before vLLM is imported, as `make train` does; -v prints everything
