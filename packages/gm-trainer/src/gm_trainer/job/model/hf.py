"""``model.source: hf``: any ``transformers`` causal LM, from a local config (random init) and
optionally local weights. Needs the optional extra ``gm-trainer[hf]``; nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gm_config import ConfigError, divisors

EXTRA_HINT = "install the optional extra: pip install 'gm-trainer[hf]'"


def require_transformers(what: str) -> Any:
    """The ``transformers`` module, or a :class:`ConfigError` naming ``what`` needs it."""
    try:
        import safetensors  # noqa: F401 - weights and export are safetensors files
        import transformers
    except ImportError as e:
        raise ConfigError(
            f"{what} needs transformers and safetensors ({e}); {EXTRA_HINT}"
        ) from None
    return transformers


def load_hf_config(config: str | Mapping[str, Any]) -> Any:
    """A ``PretrainedConfig`` from a local folder (its ``config.json``) or an inline mapping
    (with ``model_type``); :class:`ConfigError` when it is neither, or when transformers
    rejects a value (naming the file and the key)."""
    transformers = require_transformers("model.source: hf")
    if isinstance(config, Mapping):
        fields = dict(config)
        model_type = fields.pop("model_type", None)
        if not isinstance(model_type, str):
            raise ConfigError(
                "model.config: an inline mapping needs model_type (e.g. llama, gpt2), got "
                f"{model_type!r}"
            )
        where = config_source(config)
        try:
            hf_config = transformers.AutoConfig.for_model(model_type, **fields)
        except Exception as e:  # transformers' own and huggingface_hub's validation errors
            raise _bad_config(e, where, fields, "the mapping") from None
        check_hf_config(hf_config, where)
        return hf_config
    folder = Path(config)
    file = folder / "config.json"
    where = config_source(config)
    if not file.is_file():
        raise ConfigError(
            f"model.config: {folder} is not a Hugging Face model folder (no config.json); give "
            "a folder written by save_pretrained, or an inline mapping with model_type"
        )
    try:
        fields = json.loads(file.read_bytes().decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        raise ConfigError(
            f"model.config: {file} is not a UTF-8 JSON object ({e}); repair the file or write "
            "it again with save_pretrained"
        ) from None
    if not isinstance(fields, dict):
        raise ConfigError(f"model.config: {file} holds a {type(fields).__name__}, not an object")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:
        raise _bad_config(e, where, fields, str(file)) from None
    check_hf_config(hf_config, where)
    return hf_config


def config_source(config: str | Mapping[str, Any]) -> str:
    """How errors name ``model.config``: its ``config.json``, or the inline mapping."""
    if isinstance(config, Mapping):
        return f"model.config (the inline {config.get('model_type')} mapping)"
    return f"model.config: {Path(config) / 'config.json'}"


def _bad_config(error: Exception, where: str, fields: Mapping[str, Any], place: str) -> ConfigError:
    """transformers' rejection of a config, with the keys it is about and their values."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()).rstrip(".")
    said = text.lower()
    keys = [
        f"{key}={value!r}"
        for key, value in fields.items()
        if key.lower() in said or key.removeprefix("num_").replace("_", " ") in said
    ]
    about = f" (keys: {', '.join(keys)})" if keys else ""
    return ConfigError(
        f"{where} is rejected by transformers{about}: {type(error).__name__}: {text}; "
        f"correct {'those keys' if keys else 'the key it names'} in {place}"
    )


def check_hf_config(hf_config: Any, where: str) -> None:
    """:class:`ConfigError` for attention heads that do not divide: the model builds, but its
    first forward fails (or, on some architectures, silently drops heads).

    The keys are named as the config file spells them (GPT-2's ``n_head`` for
    ``num_attention_heads``).
    """

    def value(name: str) -> Any:
        number = getattr(hf_config, name, None)
        return number if isinstance(number, int) and not isinstance(number, bool) else None

    def key(name: str) -> str:
        return dict(getattr(hf_config, "attribute_map", {}) or {}).get(name, name)

    heads, kv_heads = value("num_attention_heads"), value("num_key_value_heads")
    hidden, head_dim = value("hidden_size"), value("head_dim")
    if heads is not None and heads < 1:
        raise ConfigError(f"{where}: {key('num_attention_heads')}={heads} must be >= 1")
    if heads and kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        raise ConfigError(
            f"{where}: {key('num_attention_heads')}={heads} is not a multiple of "
            f"{key('num_key_value_heads')}={kv_heads}: grouped-query attention shares each "
            "key/value head among an equal number of query heads; make "
            f"{key('num_key_value_heads')} a divisor of {key('num_attention_heads')} "
            f"(e.g. {max(d for d in divisors(heads) if d <= kv_heads)})"
        )
    if heads and hidden is not None and head_dim is None and hidden % heads:
        raise ConfigError(
            f"{where}: {key('hidden_size')}={hidden} is not a multiple of "
            f"{key('num_attention_heads')}={heads}: each head gets hidden_size / heads "
            "dimensions; change one of them (or give head_dim)"
        )


def check_causal_lm(hf_config: Any) -> None:
    """:class:`ConfigError` unless ``AutoModelForCausalLM`` knows the architecture."""
    transformers = require_transformers("model.source: hf")
    mapping = transformers.AutoModelForCausalLM._model_mapping
    if type(hf_config) not in mapping:
        raise ConfigError(
            f"model.config: model_type {hf_config.model_type!r} has no causal LM in "
            "transformers (AutoModelForCausalLM); choose a decoder architecture"
        )


def weight_files(weights: str | Sequence[str]) -> list[Path]:
    """The safetensors files of ``weights``: a HF model folder, a file, or a list of files."""
    paths = [Path(weights)] if isinstance(weights, str) else [Path(p) for p in weights]
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if not found:
                raise ConfigError(
                    f"model.weights: {path} holds no *.safetensors file; save the model with "
                    "save_pretrained (safe_serialization) or list the files"
                )
            files += found
        elif path.is_file() and path.suffix == ".safetensors":
            files.append(path)
        else:
            raise ConfigError(f"model.weights: {path} is neither a folder nor a .safetensors file")
    return files


def load_weights(trainer: Any, weights: str | Sequence[str]) -> None:
    """Copy the tensors of the safetensors files into ``trainer``'s model after its first
    compile, each rank reading only the piece it keeps (``safe_open(...).get_slice``: its FSDP
    rows, TP piece, experts; nothing of another pipeline stage's). The names are checked by
    :func:`check_weight_keys` first; a tensor whose shape differs from the model's is a
    :class:`ConfigError`."""
    from safetensors import safe_open

    model = trainer.model
    files = weight_files(weights)
    keys: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            keys.update(dict.fromkeys(f.keys(), path))
    check_weight_keys(model, set(keys))
    canonical = _canonical_names(model)
    state = dict(model.state_dict(keep_vars=True))
    for path in files:
        with safe_open(str(path), framework="pt") as f, torch.no_grad():
            for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                name = canonical.get(key, key)
                if name != key and name in keys:
                    continue  # a tied alias: its twin's tensor is read
                where = trainer.local_piece(name)
                file_shape = tuple(f.get_slice(key).get_shape())
                if file_shape != trainer.whole_shape(name):
                    raise ConfigError(
                        f"model.weights: {path.name} holds {key!r} of shape {file_shape}, but "
                        f"the model's is {tuple(trainer.whole_shape(name))}; give the weights "
                        "saved with this model.config"
                    )
                if where is not None:
                    state[key].copy_(f.get_slice(key)[where])


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every state name -> the first name of its tensor (a tied alias -> its twin)."""
    first: dict[int, str] = {}
    names: dict[str, str] = {}
    for name, tensor in (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ):
        names[name] = first.setdefault(id(tensor), name)
    return names


def check_weight_keys(model: nn.Module, keys: set[str]) -> None:
    """:class:`ConfigError` unless ``keys`` cover every parameter and persistent buffer of
    ``model`` (a tied alias counts when its twin is there) and hold nothing else."""
    own = set(model.state_dict())
    twins: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        twins.setdefault(id(param), set()).add(name)
    covered = set(keys)
    for names in twins.values():
        if names & keys:
            covered |= names
    missing = sorted(own - covered)
    unexpected = sorted(keys - own)
    if missing or unexpected:
        raise ConfigError(
            f"model.weights: the files do not fit model.config (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}); give the weights saved with this config"
        )


def check_weights(hf_config: Any, weights: str | Sequence[str]) -> None:
    """Check the weight files' tensor names against the config's model, built on the meta
    device (no memory), so a mismatch is reported before any rank starts."""
    from safetensors import safe_open

    keys: set[str] = set()
    for path in weight_files(weights):
        with safe_open(str(path), framework="pt") as f:
            keys |= set(f.keys())
    check_weight_keys(meta_model(hf_config, "model.weights"), keys)


def meta_model(hf_config: Any, where: str) -> nn.Module:
    """The causal LM of ``hf_config`` on the meta device (no memory, no weights: each rank
    allocates its pieces at the first compile, with the values a real build after the same
    seed gives), or a :class:`ConfigError` naming ``where`` when transformers cannot build
    it."""
    transformers = require_transformers(where)
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(
            f"{where}: transformers cannot build the {hf_config.model_type} causal LM of this "
            f"config ({type(e).__name__}: {first}); correct the key it names"
        ) from None


def decoder_layers(model: nn.Module) -> list[str]:
    """Names of the decoder layers: modules of a class in ``_no_split_modules``, else the
    children of the first ``layers``/``h`` ModuleList."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    names = [n for n, m in model.named_modules() if type(m).__name__ in classes]
    if names:
        return names
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("layers", "h") and isinstance(module, nn.ModuleList):
            return [f"{name}.{i}" for i in range(len(module))]
    return []


def default_sharding(model: nn.Module) -> dict[str, Any] | None:
    """The FSDP plan for a HF model: each decoder layer one block, every other parameter
    sharded with its own module (as without a plan). ``None`` when no layer is found."""
    layers = decoder_layers(model)
    if not layers:
        return None
    modules: list[str] = []
    for fqn, _ in model.named_parameters():
        owner = next((n for n in layers if fqn.startswith(n + ".")), fqn.rpartition(".")[0])
        if owner and owner not in modules:  # a root parameter would make one block
            modules.append(owner)
    return {"fsdp": {"enabled": True, "modules": [{"name": n} for n in modules]}}


def hf_lm_loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross entropy of a HF causal LM on already shifted ``targets``."""
    logits = model(input_ids=tokens, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
