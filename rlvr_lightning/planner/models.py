"""The model a plan is for: its Hugging Face configuration, never its weights.

`data.model_name_or_path` names it as for `make train`: the embedded policies by name, a local model
directory, a `config.json` file, an HF model id whose configuration ships with the library
(`rlvr_lightning/planner/model_configs/`, configuration numbers only, copied from the models' published
`config.json`), or any other HF id the local cache or the hub can resolve.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlvr_lightning.errors import ConfigError

SHIPPED = Path(__file__).parent / "model_configs"


def shipped_models() -> list[str]:
    """HF ids of the configurations that ship with the library."""
    return sorted(p.stem.replace("--", "/") for p in SHIPPED.glob("*.json"))


def model_config(name_or_path: str):
    """The `PretrainedConfig` of the model `name_or_path` names (see the module's docstring)."""
    from transformers import AutoConfig

    from rlvr_lightning.models.warm_start import EMBEDDED_WARM_STARTS

    if name_or_path in EMBEDDED_WARM_STARTS:
        from rlvr_lightning.models.embedded import build_char_tokenizer, tiny_qwen2_config

        return tiny_qwen2_config(build_char_tokenizer(), EMBEDDED_WARM_STARTS[name_or_path].spec)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"data.model_name_or_path: {name_or_path} is a directory without a config.json")
    shipped = SHIPPED / f"{name_or_path.replace('/', '--')}.json"
    for candidate in (path, shipped):
        if candidate.suffix == ".json" and candidate.is_file():
            return _from_json(candidate)
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"data.model_name_or_path: no model configuration for {name_or_path!r} ({str(err).splitlines()[0]}); "
            f"give a local model directory or config.json, or one of: {', '.join(shipped_models())}"
        ) from None


def _from_json(path: Path):
    from transformers import AutoConfig

    try:
        values = json.loads(path.read_text())
        return AutoConfig.for_model(values.pop("model_type"), **values)
    except (json.JSONDecodeError, KeyError, ValueError) as err:
        raise ConfigError(f"{path}: not a model configuration (config.json) transformers can read: {err!r}") from None
