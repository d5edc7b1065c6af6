"""The model zoo: tiny random-init configurations of real architectures, built offline.

Each :class:`Architecture` builds a fresh model (same weights for the same seed), a
deterministic global batch for a step, and names its train_fn. Sizes are odd where the
architecture allows (vocabularies of 61/67/97 rows: uneven FSDP shards), embeddings are tied
where the architecture ties them. Nothing is downloaded: configs are built in code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

VOCAB = 61  # odd and prime: 2 ranks hold 31 + 30 rows, 4 ranks 16 + 16 + 16 + 13
SEQ = 8


@dataclass(frozen=True)
class Architecture:
    """One zoo entry."""

    name: str
    build: Callable[..., nn.Module]
    """``build(dropout=True)``: a fresh model; weights depend only on the seed set before the
    call. ``dropout=False`` sets every dropout and stochastic-depth probability to 0 (ranks
    that see other slices of the batch draw other masks than one process on all of it)."""
    batch: Callable[[int, int], tuple[Any, Any]]
    """``batch(step, rows)`` -> the global ``(input, label)`` of that step."""
    train_fn: Callable[[nn.Module, Any, Any], torch.Tensor]
    family: str
    """``decoder``, ``encoder``, ``encoder-decoder``, ``vision`` or ``moe``."""
    expected_error: str | None = None
    """A regex the project's own error must match: the architecture cannot be taken yet."""
    tags: frozenset[str] = field(default_factory=frozenset)
    note: str = ""
    """For an unsupported configuration: what taking it would need."""
    discontinuous: bool = False
    """Top-k routing: noise from another summation order can flip a near-tie expert choice, so
    the sharded rows compare only against the reference that sums in the same order."""
    not_run: dict[str, str] = field(default_factory=dict)
    """Rows (as conftest.ROWS names them) this architecture does not run, and why."""


def hf_loss(model: nn.Module, input: dict[str, torch.Tensor], label: torch.Tensor) -> torch.Tensor:
    """The loss a HF model computes from ``labels``."""
    return model(**input, labels=label).loss


def logits_ce(model: nn.Module, input: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a plain module's logits."""
    logits = model(input)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1))


def _generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def token_batch(step: int, rows: int, vocab: int = VOCAB) -> tuple[Any, Any]:
    """Causal LM: the labels are the input ids (the model shifts them)."""
    ids = torch.randint(0, vocab, (rows, SEQ), generator=_generator(step))
    return {"input_ids": ids}, ids.clone()


def masked_batch(step: int, rows: int, vocab: int = VOCAB) -> tuple[Any, Any]:
    """Masked LM: every row predicts the same positions, so each row (and each rank's slice)
    holds as many labelled tokens and mean-of-means is the global mean."""
    ids = torch.randint(4, vocab, (rows, SEQ), generator=_generator(step))
    labels = torch.full_like(ids, -100)
    labels[:, 1::3] = ids[:, 1::3]
    masked = ids.clone()
    masked[:, 1::3] = 3  # the [MASK] id of these configs
    return {"input_ids": masked, "attention_mask": torch.ones_like(ids)}, labels


def seq2seq_batch(step: int, rows: int, vocab: int = VOCAB) -> tuple[Any, Any]:
    gen = _generator(step)
    source = torch.randint(3, vocab, (rows, SEQ), generator=gen)
    target = torch.randint(3, vocab, (rows, SEQ - 2), generator=gen)
    return {"input_ids": source, "attention_mask": torch.ones_like(source)}, target


def image_batch(step: int, rows: int, size: int = 32, classes: int = 5) -> tuple[Any, Any]:
    gen = _generator(step)
    pixels = torch.randn(rows, 3, size, size, generator=gen)
    return {"pixel_values": pixels}, torch.randint(0, classes, (rows,), generator=gen)


def plain_image_batch(step: int, rows: int) -> tuple[Any, Any]:
    (input, label) = image_batch(step, rows, size=16)
    return input["pixel_values"], label


def plain_token_batch(step: int, rows: int) -> tuple[Any, Any]:
    gen = _generator(step)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


# --- builders --------------------------------------------------------------------------------

_DECODER = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2}


def _hf(model_class: str, config_class: str, **kwargs: Any) -> Callable[..., nn.Module]:
    def build(dropout: bool = True) -> nn.Module:
        import transformers

        config = getattr(transformers, config_class)(**kwargs)
        if not dropout:  # every dropout probability of the config, whatever its name
            for key, value in config.to_dict().items():
                # drop_path: stochastic depth; jitter_noise: a router's random perturbation
                random = ("dropout", "pdrop", "drop_path", "jitter_noise")
                if any(word in key for word in random) and isinstance(value, float):
                    setattr(config, key, 0.0)
        return getattr(transformers, model_class)(config)

    build.__qualname__ = f"build_{model_class}"
    return build


def _llama_like(**extra: Any) -> dict[str, Any]:
    return {
        **_DECODER,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        **extra,
    }


class TinySeq2SeqTransformer(nn.Module):
    """``torch.nn.Transformer`` between token embeddings and an LM head (tied)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, dropout: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(
            d_model=dim,
            nhead=4,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dim_feedforward=48,
            dropout=0.1 if dropout else 0.0,
            batch_first=True,
        )
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.transformer(x, x, tgt_mask=mask, tgt_is_causal=True))


class PlainCNN(nn.Module):
    """Conv2d, BatchNorm2d, ReLU, max-pool, a second conv block and a linear classifier."""

    def __init__(self, classes: int = 5, dropout: bool = True) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 12, 3, padding=1, bias=False),
            nn.BatchNorm2d(12),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Dropout(0.1 if dropout else 0.0),
        )
        self.classifier = nn.Linear(12, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def _encoder(**extra: Any) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 48,
        "max_position_embeddings": 64,
        **extra,
    }


# GPT-2's config names (GPT-J shares them); token 0 as BOS/EOS keeps them inside the vocabulary.
_GPT2 = {
    "vocab_size": VOCAB,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
}

_VISION = {"image_size": 32, "num_labels": 5}


#: The batch a transformers model of each family trains on.
_FAMILY_BATCH: dict[str, Callable[[int, int], tuple[Any, Any]]] = {
    "decoder": token_batch,
    "moe": token_batch,
    "encoder": masked_batch,
    "encoder-decoder": seq2seq_batch,
    "vision": image_batch,
}


def hf(
    name: str,
    model: str,
    family: str,
    config: dict[str, Any],
    *,
    tags: tuple[str, ...] = (),
    expected_error: str | None = None,
    discontinuous: bool = False,
    note: str = "",
) -> Architecture:
    """A transformers model class built from a config class of the same family, trained on
    its family's batch."""
    config_class = model.split("For")[0].replace("LMHeadModel", "") + "Config"
    return Architecture(
        name,
        _hf(model, config_class, **config),
        _FAMILY_BATCH[family],
        hf_loss,
        family,
        expected_error,
        frozenset((*tags, "transformers")),  # built by transformers: the zoo's test dependency
        note,
        discontinuous,
    )


_MIXTRAL = _llama_like(
    num_local_experts=4, num_experts_per_tok=2, experts_implementation="batched_mm"
)
_QWEN2_MOE = _llama_like(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    experts_implementation="batched_mm",
)

#: The tiny mixture of experts every MoE row starts from (hidden 64, 4 experts, top-2, 2
#: layers, MLA dims for the DeepSeek-like): each row's config class takes the keys it has,
#: the others are left out, so one table serves configs that name the same thing differently
#: (``num_experts``, ``num_local_experts``, ``n_routed_experts``). No experts_implementation:
#: transformers' default (``grouped_mm``). No cache: a training step builds none.
_MOE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "top_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "first_k_dense_replace": 0,  # every layer a MoE layer
    "moe_layer_freq": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "use_cache": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


def _hf_moe(model_class: str, overrides: dict[str, Any]) -> Callable[..., nn.Module]:
    """Builds ``model_class`` from ``_MOE`` (the keys its config class has) and ``overrides``."""
    config_class = model_class.split("For")[0] + "Config"

    def build(dropout: bool = True) -> nn.Module:
        import transformers

        known = getattr(transformers, config_class)().to_dict()
        config = {k: v for k, v in _MOE.items() if k in known}
        if "qk_rope_head_dim" in known:  # multi-head latent attention: no head_dim of its
            config.pop("head_dim", None)  # own, and as many key/value heads as query heads
            config["num_key_value_heads"] = config["num_attention_heads"]
        return _hf(model_class, config_class, **{**config, **overrides})(dropout)

    build.__qualname__ = f"build_{model_class}"
    return build


_BF16 = "bf16 = FSDP2 bf16"


def moe(
    name: str,
    model: str,
    *,
    tags: tuple[str, ...] = (),
    not_run: dict[str, str] | None = None,
    expected_error: str | None = None,
    note: str = "",
    **overrides: Any,
) -> Architecture:
    """A transformers mixture of experts with its default experts kernel, built from ``_MOE``
    (``overrides``: fields of its config that differ)."""
    return Architecture(
        name,
        _hf_moe(model, overrides),
        token_batch,
        hf_loss,
        "moe",
        expected_error,
        tags=frozenset((*tags, "transformers")),
        note=note,
        discontinuous=True,
        not_run=not_run or {},
    )


#: The rows the per-expert loop of the architectures outside the issue's list does not run:
#: the passes run on the same architecture with its default experts kernel.
_LOOP_ONE_PROCESS = dict.fromkeys(
    ["PP 2 stages = whole graph, bitwise", "FSDP 2 ranks", "FSDP 2 ranks, reshard", _BF16],
    "the per-expert loop row checks the capture (one process, bitwise); the passes run on "
    "the same architecture with its default experts kernel",
)


def expert_loop(name: str, model: str, *, every_row: bool = True) -> Architecture:
    """``moe(name, model)`` with transformers' per-expert Python loop
    (``experts_implementation="eager"``), which graph mode captures as a static loop over every
    expert (gm_trace.capture.expert_loop); ``every_row=False``: the one-process row only."""
    return moe(
        f"{name}-expert-loop",
        model,
        not_run=None if every_row else _LOOP_ONE_PROCESS,
        experts_implementation="eager",
    )


#: An expert or router weight's update in bfloat16 ends 5-7 % of its norm (hunyuan-v1-moe: 7
#: times) off FSDP2's, beyond the bf16 tolerance. Top-k routing is discontinuous: one near-tie
#: expert choice rounded the other way does that; not traced to the op.
_BF16_ROUTING = {
    _BF16: "a weight's update ends beyond the bf16 tolerance of FSDP2's (top-k routing is "
    "discontinuous; not traced to the op)"
}


#: The per-expert-loop architectures of the issue (every row in the opt-in set zoo).
_EXPERT_LOOP_CI = [
    ("mixtral", "MixtralForCausalLM"),
    ("qwen2-moe", "Qwen2MoeForCausalLM"),
    ("qwen3-moe", "Qwen3MoeForCausalLM"),
    ("olmoe", "OlmoeForCausalLM"),
    ("deepseek-v3", "DeepseekV3ForCausalLM"),
    ("gpt-oss", "GptOssForCausalLM"),
]

#: Their one-layer variants, whose one step the default suite checks (test_zoo.py): the loop
#: is per layer, and one layer traces in half the time.
EXPERT_LOOP_CI: list[Architecture] = [
    moe(f"{name}-expert-loop-1-layer", model, experts_implementation="eager", num_hidden_layers=1)
    for name, model in _EXPERT_LOOP_CI
]

ARCHITECTURES: list[Architecture] = [
    # decoders
    hf("gpt2", "GPT2LMHeadModel", "decoder", _GPT2, tags=("layernorm", "ci")),
    hf(
        "gpt-neox",
        "GPTNeoXForCausalLM",
        "decoder",
        {
            **_DECODER,
            "num_attention_heads": 4,
            "intermediate_size": 48,
            "max_position_embeddings": 64,
        },
    ),
    hf(
        "llama",
        "LlamaForCausalLM",
        "decoder",
        _llama_like(tie_word_embeddings=True),
        tags=("rmsnorm", "ci"),
    ),
    hf("mistral", "MistralForCausalLM", "decoder", _llama_like(sliding_window=4)),
    hf("qwen2", "Qwen2ForCausalLM", "decoder", _llama_like()),
    hf("gemma", "GemmaForCausalLM", "decoder", _llama_like(head_dim=8)),
    hf(
        "phi",
        "PhiForCausalLM",
        "decoder",
        {
            **_DECODER,
            "intermediate_size": 48,
            "num_attention_heads": 4,
            "max_position_embeddings": 64,
        },
    ),
    hf(
        "opt",
        "OPTForCausalLM",
        "decoder",
        {
            **_DECODER,
            "ffn_dim": 48,
            "num_attention_heads": 4,
            "max_position_embeddings": 64,
            "word_embed_proj_dim": 32,
        },
    ),
    hf(
        "bloom",
        "BloomForCausalLM",
        "decoder",
        {"vocab_size": VOCAB, "hidden_size": 32, "n_layer": 2, "n_head": 4},
    ),
    hf(
        "falcon",
        "FalconForCausalLM",
        "decoder",
        {**_DECODER, "num_attention_heads": 4, "alibi": False},
    ),
    # encoders (masked LM)
    hf("bert", "BertForMaskedLM", "encoder", _encoder(), tags=("ci",)),
    hf(
        "roberta",
        "RobertaForMaskedLM",
        "encoder",
        _encoder(pad_token_id=1, max_position_embeddings=66),
    ),
    hf(
        "distilbert",
        "DistilBertForMaskedLM",
        "encoder",
        {
            "vocab_size": VOCAB,
            "dim": 32,
            "n_layers": 2,
            "n_heads": 4,
            "hidden_dim": 48,
            "max_position_embeddings": 64,
        },
    ),
    # encoder-decoders
    hf(
        "t5",
        "T5ForConditionalGeneration",
        "encoder-decoder",
        {
            "vocab_size": VOCAB,
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 48,
            "num_layers": 2,
            "num_heads": 4,
            "decoder_start_token_id": 0,
        },
    ),
    hf(
        "bart",
        "BartForConditionalGeneration",
        "encoder-decoder",
        {
            "vocab_size": VOCAB,
            "d_model": 32,
            "encoder_layers": 1,
            "decoder_layers": 1,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 48,
            "decoder_ffn_dim": 48,
            "max_position_embeddings": 64,
        },
    ),
    # vision
    hf(
        "vit",
        "ViTForImageClassification",
        "vision",
        {
            **_VISION,
            "patch_size": 8,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 48,
        },
    ),
    hf(
        "resnet",
        "ResNetForImageClassification",
        "vision",
        {
            **_VISION,
            "embedding_size": 8,
            "hidden_sizes": [8, 16],
            "depths": [1, 1],
            "layer_type": "basic",
        },
        tags=("batchnorm", "ci"),
    ),
    hf(
        "convnext",
        "ConvNextForImageClassification",
        "vision",
        {**_VISION, "hidden_sizes": [8, 16], "depths": [1, 1], "num_stages": 2},
    ),
    hf(
        "swin",
        "SwinForImageClassification",
        "vision",
        {
            **_VISION,
            "patch_size": 4,
            "embed_dim": 8,
            "depths": [1, 1],
            "num_heads": [2, 2],
            "window_size": 4,
        },
    ),
    # mixture of experts, with transformers' default experts kernel (grouped_mm: torch's fake
    # tensors get its float32 shape function from gm_trace.graph.fake_kernels) ...
    moe("mixtral", "MixtralForCausalLM"),
    moe("qwen2-moe", "Qwen2MoeForCausalLM"),
    moe("qwen3-moe", "Qwen3MoeForCausalLM", tags=("ci-moe",)),
    moe("olmoe", "OlmoeForCausalLM"),
    moe("deepseek-v3", "DeepseekV3ForCausalLM"),  # MLA, shared experts, sigmoid routing + bias
    # ... and batched_mm, which routes with gathers of static shape
    hf("mixtral-batched-mm", "MixtralForCausalLM", "moe", _MIXTRAL, discontinuous=True),
    hf("qwen2-moe-batched-mm", "Qwen2MoeForCausalLM", "moe", _QWEN2_MOE, discontinuous=True),
    # ... and the per-expert loop (experts_implementation="eager")
    *(expert_loop(name, model) for name, model in _EXPERT_LOOP_CI),
    # plain torch
    Architecture(
        "nn-transformer", TinySeq2SeqTransformer, plain_token_batch, logits_ce, "encoder-decoder"
    ),
    Architecture(
        "plain-cnn", PlainCNN, plain_image_batch, logits_ce, "vision", tags=frozenset({"batchnorm"})
    ),
]

#: Rows some of the other mixtures of experts do not run (docs/zoo.md says why).
NOT_RUN: dict[str, dict[str, str]] = {
    "glm4-moe": _BF16_ROUTING,
    "hunyuan-v1-moe": _BF16_ROUTING,
    "kolibri1": _BF16_ROUTING,
    "lara-mini": _BF16_ROUTING,
    "solar-open": _BF16_ROUTING,
    "minimax": {
        _BF16: "capture under param_dtype=bfloat16 fails: `expected scalar type torch.float32 "
        "but found torch.bfloat16` (not traced to the op)"
    },
    "phimoe": {
        _BF16: "the router's update in bf16 differs from FSDP2's by its whole norm (its "
        "sparsemixer routing; not traced to the op)"
    },
    "granitemoe-hybrid": dict.fromkeys(
        ["FSDP 2 ranks", "FSDP 2 ranks, reshard"],
        "the ranks do not finish within the harness's 180 s: the Mamba layers run "
        "transformers' reference PyTorch kernels (141 s for the one-process row, loaded)",
    ),
}

#: The other mixtures of experts of transformers that build from ``_MOE``.
_OTHER_MOE = [
    ("afmoe", "AfmoeForCausalLM"),
    ("axk1", "AXK1ForCausalLM"),
    ("beam", "BeamForCausalLM"),
    ("cohere2-moe", "Cohere2MoeForCausalLM"),
    ("deepseek-v2", "DeepseekV2ForCausalLM"),
    ("deepseek-v4", "DeepseekV4ForCausalLM"),
    ("dots1", "Dots1ForCausalLM"),
    ("ernie4.5-moe", "Ernie4_5_MoeForCausalLM"),
    ("exaone-moe", "ExaoneMoeForCausalLM"),
    ("flex-olmo", "FlexOlmoForCausalLM"),
    ("flint", "FlintForCausalLM"),
    ("glm4-moe", "Glm4MoeForCausalLM"),
    ("glm4-moe-lite", "Glm4MoeLiteForCausalLM"),
    ("gpt-oss", "GptOssForCausalLM"),
    ("granitemoe", "GraniteMoeForCausalLM"),
    ("granitemoe-swa", "GraniteMoeSWAForCausalLM"),
    ("granitemoe-hybrid", "GraniteMoeHybridForCausalLM"),
    ("granitemoe-shared", "GraniteMoeSharedForCausalLM"),
    ("hunyuan-v1-moe", "HunYuanMoEV1ForCausalLM"),
    ("hy-v3", "HYV3ForCausalLM"),
    ("hy-v4", "HYV4ForCausalLM"),
    ("jamba", "JambaForCausalLM"),
    ("kolibri1", "Kolibri1ForCausalLM"),
    ("laguna", "LagunaForCausalLM"),
    ("lara-mini", "LaraMiniForCausalLM"),
    ("mellum", "MellumForCausalLM"),
    ("mimo-v2-flash", "MiMoV2FlashForCausalLM"),
    ("minimax", "MiniMaxForCausalLM"),
    ("minimax-m2", "MiniMaxM2ForCausalLM"),
    ("nemotron-h", "NemotronHForCausalLM"),
    ("phimoe", "PhimoeForCausalLM"),
    ("qwen3-next", "Qwen3NextForCausalLM"),
    ("solar-open", "SolarOpenForCausalLM"),
]

#: Per-expert loops graph mode refuses (none today: see UNSUPPORTED).
_LOOP_UNSUPPORTED: set[str] = set()

#: Architectures outside the issue's list, built the same way: the fixes must be general.
EXTRA_ARCHITECTURES: list[Architecture] = [
    hf("gpt-j", "GPTJForCausalLM", "decoder", {**_GPT2, "rotary_dim": 4}),
    hf("qwen3", "Qwen3ForCausalLM", "decoder", _llama_like(head_dim=8)),
    hf("electra", "ElectraForMaskedLM", "encoder", _encoder(embedding_size=16)),
    hf(
        "mobilenet-v2",
        "MobileNetV2ForImageClassification",
        "vision",
        {**_VISION, "depth_multiplier": 0.25},
        tags=("batchnorm",),
    ),
    # every other mixture of experts of transformers that builds from _MOE (docs/zoo.md lists
    # the ones left out and why), with its default experts kernel and its per-expert loop
    *(moe(name, model, not_run=NOT_RUN.get(name)) for name, model in _OTHER_MOE),
    *(
        expert_loop(name, model, every_row=False)
        for name, model in _OTHER_MOE
        if name not in _LOOP_UNSUPPORTED and (name, model) not in _EXPERT_LOOP_CI
    ),
]


#: Configurations graph mode cannot take yet: each must end in the project's own error that
#: names the op and the module.
UNSUPPORTED: list[Architecture] = []
"""None today: Nemotron-H's per-expert loop, the last one, lost its branch on each expert's
token count in transformers 5.25 and is captured bitwise like the other loops."""

#: The mixtures of experts of transformers 5.24 (the model types whose experts use
#: ``use_experts_implementation``) that have no row, and why.
MOE_LEFT_OUT: dict[str, str] = {
    **dict.fromkeys(
        [
            "aria",
            "deepseek_ocr2",
            "diffusion_gemma",
            "ernie4_5_vl_moe",
            "glm4v_moe",
            "glm5_next",
            "hy_v4_vl",
            "inkling",
            "inkling2",
            "inkling2_loop",
            "minimax_m3_vl",
            "mistral4",
            "mistral_large4",
            "muse_spark",
            "openai_privacy_filter",
            "qwen3_omni_moe",
            "qwen3_vl_moe",
            "unlimited_ocr",
        ],
        "no causal-LM class (multimodal, diffusion or classification heads): the zoo's token "
        "batch does not fit",
    ),
    **dict.fromkeys(
        ["gemma4", "qwen3_5_moe", "qwen4_exp"],
        "the text model's config is nested (`text_config`), which `_MOE` does not reach",
    ),
    **dict.fromkeys(
        ["axk2", "deepseek_v32", "glm_moe_dsa"],
        "eager fails on `_MOE` (the sparse-attention indexer wants dims of its own)",
    ),
    **dict.fromkeys(
        ["bailing_hybrid", "dots3_note", "kimi_linear", "lfm2_moe", "zaya"],
        "the config rejects `_MOE` or eager fails on it (linear-attention and hybrid layouts "
        "that need a configuration of their own)",
    ),
}

BY_NAME = {
    arch.name: arch for arch in ARCHITECTURES + EXTRA_ARCHITECTURES + UNSUPPORTED + EXPERT_LOOP_CI
}
