"""The models of the sweep (``benchmarks/sweep.py``, issue 24): every architecture ``transformers`` can
build from a small config, plus the cases its auto mappings do not cover, each in a LightningModule on
random inputs fitted to its head.

A :class:`Case` names a builder that returns a :class:`Built` (the module, the Trainer options its
recipe needs, the :class:`DebugConfig` overrides it runs under). :func:`auto_cases` walks the auto-model
mappings, one case per distinct ``model_type`` (the first head found in :data:`HEADS` order);
:data:`HAND_CASES` are written here. :func:`fit_case` trains one case in a real ``lightning.Trainer``
(CPU) and reads back the findings of severity warning and above.

The size table (:data:`SMALL`) and the per-family overrides (:data:`OVERRIDES`) are about building a
model small enough to train on CPU in seconds; they say nothing about the debugger's rules. Nothing is
downloaded: a model that needs files (a tokenizer, a pretrained backbone, remote code) fails to build
and is recorded as skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_debug import DebugConfig, debug_callbacks
from tests.harness.toolkit import debug_dir, make_trainer, read_events, read_report
from tests.harness.zoo import HEALTHY, SERIOUS, DictDataset, HFModule, Plant, Result

STEPS = 30
BATCH = 4
SEQ = 16
VOCAB = 256
IMAGE = 32
AUDIO_SAMPLES = 4000
SAMPLES = STEPS * BATCH


# --- settings ---------------------------------------------------------------------------------------------------


def default_setting(**overrides: Any) -> DebugConfig:
    """The defaults a new user gets (``DebugConfig()``), with no summary printed and no plot drawn."""
    return DebugConfig(**dict(dict(print_summary=False, save_plots=False), **overrides))


def every_step_setting(**overrides: Any) -> DebugConfig:
    """Every check every step: each ``*_frequency`` field of DebugConfig set to 1."""
    frequencies = {field.name: 1 for field in dataclasses.fields(DebugConfig) if field.name.endswith("_frequency")}
    return default_setting(**dict(frequencies, **overrides))


SETTINGS: dict[str, Callable[..., DebugConfig]] = {"defaults": default_setting, "every_step": every_step_setting}


# --- cases ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Built:
    """A case ready to train: the module, its Trainer options and the DebugConfig overrides it runs under."""

    module: pl.LightningModule
    trainer_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    config_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Case:
    """One architecture of the sweep: ``source`` is ``auto:<head>`` or ``hand``."""

    name: str
    source: str
    what: str
    build: Callable[[], Built]


class Skip(Exception):
    """The case cannot be built here (needs files, a package, or no loss from labels); the message says why."""


# --- shrinking a transformers config ------------------------------------------------------------------------------

# Size fields a config may carry and the small value each gets (only fields the config already has).
SMALL: dict[str, int] = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "dim": 32, "model_dim": 32, "emb_dim": 32,
    "embedding_size": 32, "word_embed_proj_dim": 32, "projection_dim": 32, "d_embed": 32, "n_embed": 32,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2, "num_encoder_layers": 2, "num_hidden_groups": 1,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_decoder_attention_heads": 4,
    "intermediate_size": 64, "ffn_dim": 64, "d_ff": 64, "n_inner": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    "ffn_hidden_size": 64, "hidden_dim": 64, "inner_hidden_size": 64, "dim_feedforward": 64, "mlp_dim": 64,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "d_inner": 64, "d_kv": 8, "head_dim": 8, "kv_channels": 8, "attention_head_dim": 8,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "vocab_size": VOCAB, "decoder_vocab_size": VOCAB, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64,
    "max_seq_len": 64, "max_sequence_length": 64, "seq_length": 64, "image_size": IMAGE, "num_labels": 2,
}
# Key/value heads divide the attention heads (4); routed experts per token stay below the experts (4).
SMALL_AT_MOST: dict[str, int] = {
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_shared_experts": 1, "num_shared_experts": 1,
    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "n_group": 1, "topk_group": 1, "rotary_dim": 8, "rope_dim": 8,
}
# Lists of sizes (stages of a vision model, convolutions of an audio encoder) shrink element-wise.
SMALL_LISTS: dict[str, int] = {"hidden_sizes": 32, "conv_dim": 32, "embed_dims": 32, "dims": 32, "channels": 32,
                               "neck_hidden_sizes": 32, "embedding_dims": 32}
SMALL_DEPTHS = ("depths", "num_layers_per_stage", "depth", "layers")
# Lists of heads per stage become 2 per stage (the stage widths above stay multiples of 2).
SMALL_HEAD_LISTS = ("num_heads", "num_attention_heads", "heads")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id",
             "mask_token_id", "unk_token_id")
SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder", "backbone_config")


def _get(config: Any, name: str) -> Any:
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - a per-layer attribute some configs refuse to read globally
        return None


def _set(config: Any, name: str, value: Any) -> None:
    try:
        setattr(config, name, value)
    except Exception:  # noqa: BLE001 - a derived (read-only) field or one the config refuses to set
        pass


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shrink(config: Any) -> Any:
    """``config`` with its size fields made small, sub-configs included; token ids kept inside the vocabulary.

    Fields a config derives (read-only properties) or refuses to set are left as they are.
    """
    for name, value in SMALL.items():
        if _is_int(_get(config, name)):
            _set(config, name, value)
    for name, value in SMALL_AT_MOST.items():
        current = _get(config, name)
        if _is_int(current) and current > value:
            _set(config, name, value)
    for name, value in SMALL_LISTS.items():
        current = _get(config, name)
        if isinstance(current, (list, tuple)) and current and all(_is_int(v) for v in current):
            _set(config, name, [min(v, value // 2 * 2 ** i) for i, v in enumerate(current)])
    for name in SMALL_DEPTHS:
        current = _get(config, name)
        if isinstance(current, (list, tuple)) and current and all(_is_int(v) for v in current):
            _set(config, name, [1] * len(current))
    for name in SMALL_HEAD_LISTS:
        current = _get(config, name)
        if isinstance(current, (list, tuple)) and current and all(_is_int(v) for v in current):
            _set(config, name, [2] * len(current))
    for name in TOKEN_IDS:
        current = _get(config, name)
        if _is_int(current) and current >= VOCAB:
            _set(config, name, min(TOKEN_IDS.index(name), 2))
        elif isinstance(current, list):
            _set(config, name, [v if v < VOCAB else 2 for v in current])
    for name in SUB_CONFIGS:
        sub = _get(config, name)
        if sub is not None and hasattr(sub, "to_dict"):
            shrink(sub)
    _shrink_layer_types(config)
    if _is_int(_get(config, "kv_lora_rank")) and _is_int(_get(config, "num_attention_heads")):
        _set(config, "num_key_value_heads", config.num_attention_heads)  # latent attention (MLA) has no GQA
    return config


def _shrink_layer_types(config: Any) -> None:
    """A per-layer list of kinds (attention, linear attention, sliding window) cut to the small depth, with
    every kind it had kept once: a hybrid model whose first layers are all of one kind breaks otherwise."""
    layer_types = _get(config, "layer_types")
    field = next((n for n in ("num_hidden_layers", "num_layers") if _is_int(_get(config, n))), None)
    if not isinstance(layer_types, list) or not layer_types or field is None:
        return
    kinds = list(dict.fromkeys(layer_types))
    layers = max(_get(config, field), len(kinds))
    _set(config, field, layers)
    _set(config, "layer_types", (kinds * layers)[:layers])


# Per-family settings a small model needs to construct (not about the debugger): model_type -> fields.
OVERRIDES: dict[str, dict[str, Any]] = {
    "reformer": {"axial_pos_shape": [4, 16], "axial_pos_embds_dim": [16, 16], "attn_layers": ["local", "lsh"],
                 "max_position_embeddings": 64, "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8},
    "funnel": {"block_sizes": [1, 1], "num_decoder_layers": 1},
    "transfo-xl": {"cutoffs": [64], "d_embed": 32, "div_val": 1},
    "big_bird": {"attention_type": "original_full"},
    "bigbird_pegasus": {"attention_type": "original_full"},
    "longformer": {"attention_window": 8},
    "led": {"attention_window": 8},
    "mega": {"chunk_size": 16},
    "xlnet": {"d_head": 8},
    "prophetnet": {"ngram": 2},
    "swin": {"window_size": 2, "embed_dim": 16},
    "swinv2": {"window_size": 2, "embed_dim": 16},
    "donut-swin": {"window_size": 2, "embed_dim": 16},
    "focalnet": {"embed_dim": 16},
    "vit_hybrid": {},
    "perceiver": {"num_latents": 8, "d_latents": 32, "num_self_attends_per_block": 1},
    "speech_to_text": {"input_feat_per_channel": 16, "conv_channels": 32},
}


def small_config(model_type: str) -> Any:
    from transformers import AutoConfig

    config = shrink(AutoConfig.for_model(model_type))
    for name, value in OVERRIDES.get(model_type, {}).items():
        setattr(config, name, value)
    return config


# --- inputs fitted to a head ---------------------------------------------------------------------------------------


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def token_data(head: str, config: Any, seed: int = 0) -> DictDataset:
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", VOCAB)
    ids = torch.randint(3, min(vocab, VOCAB), (SAMPLES, SEQ), generator=_generator(seed))
    eos = _get(config, "eos_token_id")
    if _is_int(eos) and eos < VOCAB:
        ids[:, -1] = eos  # models that pool at the end-of-sequence token (T5, BART classifiers) need one
    tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if head == "sequence_classification":
        tensors["labels"] = (ids[:, 0] % 2).long()
    elif head == "seq2seq":
        tensors["labels"] = ids.flip(1)
    else:
        tensors["labels"] = ids
    return DictDataset(tensors)


def image_data(config: Any, seed: int = 0) -> DictDataset:
    channels = getattr(config, "num_channels", 3)
    size = getattr(config, "image_size", IMAGE)
    size = size[0] if isinstance(size, (list, tuple)) else size
    labels = torch.randint(0, 2, (SAMPLES,), generator=_generator(seed))
    patterns = torch.randn(2, channels, size, size, generator=_generator(seed + 1))
    pixels = torch.randn(SAMPLES, channels, size, size, generator=_generator(seed + 2)) + patterns[labels]
    return DictDataset({"pixel_values": pixels, "labels": labels})


def audio_data(model: nn.Module, config: Any, seed: int = 0) -> DictDataset:
    labels = torch.randint(0, 2, (SAMPLES,), generator=_generator(seed))
    main = getattr(model, "main_input_name", "input_values")
    if main == "input_features":
        bins = next((getattr(config, n) for n in ("num_mel_bins", "feature_size", "input_feat_per_channel")
                     if isinstance(getattr(config, n, None), int)), 80)
        frames = 2 * getattr(config, "max_source_positions", 32) if hasattr(config, "max_source_positions") else 64
        features = torch.randn(SAMPLES, bins, frames, generator=_generator(seed + 1))
        if getattr(config, "model_type", "") in ("speech_to_text",):
            features = features.transpose(1, 2).contiguous()
        return DictDataset({"input_features": features, "labels": labels})
    if main == "input_values" and hasattr(config, "num_mel_bins") and hasattr(config, "max_length"):
        values = torch.randn(SAMPLES, config.max_length, config.num_mel_bins, generator=_generator(seed + 1))
        return DictDataset({"input_values": values, "labels": labels})
    values = torch.randn(SAMPLES, AUDIO_SAMPLES, generator=_generator(seed + 1))
    return DictDataset({main: values, "labels": labels})


# --- the auto mappings --------------------------------------------------------------------------------------------

# In this order: an encoder-decoder family is trained as seq2seq (its decoder alone, as a causal LM,
# leaves the cross-attention unused), then a decoder as a causal LM, an encoder as a masked LM.
HEADS: dict[str, tuple[str, str]] = {
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "causal_lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "masked_lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "sequence_classification": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                                "AutoModelForSequenceClassification"),
    "image_classification": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    "audio_classification": ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "AutoModelForAudioClassification"),
}


# A config can only be built from files for these: ("model_type" -> why).
NEEDS_FILES: dict[str, str] = {}


def build_auto(model_type: str, head: str) -> Built:
    import transformers

    try:
        config = small_config(model_type)
    except Exception as error:  # noqa: BLE001 - any failure to configure is a reason to skip
        raise Skip(f"config: {type(error).__name__}: {str(error)[:160]}") from error
    if head == "sequence_classification" and _get(config, "pad_token_id") is None:
        _set(config, "pad_token_id", 0)
    if head in ("seq2seq", "sequence_classification") and _get(config, "decoder_start_token_id") is None:
        _set(config, "decoder_start_token_id", 0)
    auto = getattr(transformers, HEADS[head][1])
    torch.manual_seed(0)
    try:
        model = auto.from_config(config)
    except Exception as error:  # noqa: BLE001
        raise Skip(f"build: {type(error).__name__}: {str(error)[:160]}") from error
    if head == "image_classification":
        data = image_data(config)
    elif head == "audio_classification":
        data = audio_data(model, config)
    else:
        data = token_data(head, config)
    return Built(HFModule(model, data, lr=1e-3, batch_size=BATCH))


def auto_cases() -> list[Case]:
    """One case per distinct ``model_type`` of the auto mappings, with the first head of :data:`HEADS` it has."""
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return []
    cases: dict[str, Case] = {}
    for head, (mapping, _) in HEADS.items():
        for model_type, class_name in getattr(modeling_auto, mapping).items():
            if model_type in cases:
                continue
            class_name = class_name[0] if isinstance(class_name, (list, tuple)) else class_name
            cases[model_type] = Case(model_type, f"auto:{head}", class_name,
                                     lambda model_type=model_type, head=head: build_auto(model_type, head))
    return list(cases.values())


# --- cases the auto mappings do not cover -----------------------------------------------------------------------


def tiny_llama(**overrides: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**dict(dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                                **overrides))
    return LlamaForCausalLM(config)


def _causal(model: nn.Module, lr: float = 1e-3, seed: int = 0) -> HFModule:
    ids = torch.randint(3, VOCAB, (SAMPLES, SEQ), generator=_generator(seed))
    return HFModule(model, DictDataset({"input_ids": ids, "labels": ids}), lr=lr, batch_size=BATCH)


def lora() -> Built:
    """peft LoRA (r=8 on the attention projections) on a tiny Llama: lora_B starts at zero by design."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    return Built(_causal(model, lr=1e-3))


def ia3() -> Built:
    """peft IA3 on a tiny Llama: learned scaling vectors initialised to one, the base frozen."""
    from peft import IA3Config, get_peft_model

    config = IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    return Built(_causal(get_peft_model(tiny_llama(), config), lr=1e-2))


def demo_transformer() -> Built:
    from tests.harness.zoo import demo_transformer as build

    return Built(build())


def boring() -> Built:
    from tests.harness.zoo import boring as build

    return Built(build())


def frozen_backbone() -> Built:
    """A fine-tune of a tiny ResNet classifier with its backbone frozen: only the head trains."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                          layer_type="basic", num_labels=2)
    model = ResNetForImageClassification(config)
    for parameter in model.resnet.parameters():
        parameter.requires_grad_(False)
    return Built(HFModule(model, image_data(config), lr=1e-3, batch_size=BATCH))


class AdaLNZeroBlock(nn.Module):
    """A DiT block: LayerNorm without affine, shift/scale/gate from the conditioning by a zero-initialised
    linear layer (adaLN-zero), so each block starts as the identity."""

    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width))
        nn.init.zeros_(self.modulation[1].weight)
        nn.init.zeros_(self.modulation[1].bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(c).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class TinyDiT(pl.LightningModule):
    """A diffusion-style denoiser: patch tokens, a timestep embedding, adaLN-zero blocks, a ReZero scalar on
    the input path and a zero-initialised output layer (as DiT initialises its final layer); predicts the
    noise added to random 'latents', AdamW 1e-3."""

    def __init__(self, width: int = 32, depth: int = 3, tokens: int = 16, channels: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(channels, width)
        self.position = nn.Parameter(torch.randn(1, tokens, width) * 0.02)
        self.time = nn.Sequential(nn.Linear(1, width), nn.SiLU(), nn.Linear(width, width))
        self.rezero = nn.Parameter(torch.zeros(()))
        self.rezero_branch = nn.Linear(width, width)
        self.blocks = nn.ModuleList(AdaLNZeroBlock(width) for _ in range(depth))
        self.final_norm = nn.LayerNorm(width, elementwise_affine=False)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.out = nn.Linear(width, channels)
        for layer in (self.final_modulation[1], self.out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        generator = _generator(11)
        self.latents = torch.randn(SAMPLES, tokens, channels, generator=generator)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        c = self.time(t[:, None])
        h = self.embed(x) + self.position
        h = h + self.rezero * self.rezero_branch(h)
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.final_modulation(c).unsqueeze(1).chunk(2, dim=-1)
        return self.out(self.final_norm(h) * (1 + scale) + shift)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x0,) = batch
        t = torch.rand(x0.size(0), device=x0.device)
        noise = torch.randn_like(x0)
        alpha = torch.cos(t * math.pi / 2)[:, None, None]
        xt = alpha * x0 + (1 - alpha ** 2).sqrt() * noise
        return nn.functional.mse_loss(self(xt, t), noise)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.utils.data.TensorDataset(self.latents), batch_size=BATCH, shuffle=True)


def adaln_zero() -> Built:
    torch.manual_seed(0)
    return Built(TinyDiT())


def mixtral() -> Built:
    """Mixtral, 4 experts, top-2 routing (fused experts)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64)
    return Built(_causal(MixtralForCausalLM(config)))


def qwen2_moe() -> Built:
    """Qwen2-MoE, 8 experts, top-2 routing and a shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    return Built(_causal(Qwen2MoeForCausalLM(config)))


def switch(plant: Plant = HEALTHY, experts: int = 8) -> Built:
    """Switch Transformers, 8 experts, top-1 routing: some experts get no token on some steps (``plant``:
    a zoo plant, e.g. ``Plant(unused_layer=True)`` for a layer that is never used, which must still be named).
    With 32 experts for 64 tokens a step, some experts wait more than ten steps for their first token."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    torch.manual_seed(0)
    config = SwitchTransformersConfig(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                      num_decoder_layers=2, num_heads=4, num_experts=experts, expert_capacity=16,
                                      num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = SwitchTransformersForConditionalGeneration(config)
    ids = torch.randint(3, VOCAB, (SAMPLES, SEQ), generator=_generator(4))
    return Built(HFModule(model, DictDataset({"input_ids": ids, "labels": ids.flip(1)}), lr=1e-3, batch_size=BATCH,
                          plant=plant))


def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4))


def bf16_mixed() -> Built:
    """A tiny Llama under ``precision="bf16-mixed"`` (CPU autocast)."""
    return Built(_causal(tiny_llama()), {"precision": "bf16-mixed"})


def grad_accumulation() -> Built:
    """GPT-2 with ``accumulate_grad_batches=4`` and ``gradient_clip_val=1.0``."""
    return Built(_causal(tiny_gpt2()), {"accumulate_grad_batches": 4, "gradient_clip_val": 1.0})


def grad_checkpointing() -> Built:
    """A tiny Llama with ``gradient_checkpointing_enable()`` (activations recomputed in the backward)."""
    model = tiny_llama()
    model.gradient_checkpointing_enable()
    return Built(_causal(model))


def convnext() -> Built:
    """ConvNeXt, layer scale initialised to 1e-6 (its default), AdamW 1e-3."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    config = ConvNextConfig(num_channels=3, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 3, 1], num_labels=2,
                            image_size=IMAGE)
    return Built(HFModule(ConvNextForImageClassification(config), image_data(config), lr=1e-3, batch_size=BATCH))


def wav2vec2_layerdrop() -> Built:
    """wav2vec2 for audio classification with ``layerdrop=0.1`` (its default): a dropped layer gets no gradient."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    torch.manual_seed(0)
    config = Wav2Vec2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                            conv_dim=(32,) * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                            layerdrop=0.1, mask_time_prob=0.0, num_labels=2, classifier_proj_size=16)
    model = Wav2Vec2ForSequenceClassification(config)
    return Built(HFModule(model, audio_data(model, config), lr=1e-3, batch_size=BATCH))


def mobilenet_v2_advanced() -> Built:
    """MobileNetV2 (BatchNorm, convolutions initialised with std 0.02), SGD lr 0.002, at ``level="advanced"``."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(0)
    config = MobileNetV2Config(num_channels=3, image_size=IMAGE, depth_multiplier=0.35, num_labels=2)
    module = HFModule(MobileNetV2ForImageClassification(config), image_data(config), lr=0.002, batch_size=BATCH,
                      optimizer="sgd")
    return Built(module, config_overrides={"level": "advanced"})


HAND_CASES: list[Case] = [
    Case("lora_llama", "hand", "peft LoRA r=8 on q/v of a tiny Llama", lora),
    Case("ia3_llama", "hand", "peft IA3 on k/v/down of a tiny Llama", ia3),
    Case("demo_transformer", "hand", "lightning.pytorch.demos LightningTransformer", demo_transformer),
    Case("demo_boring", "hand", "lightning.pytorch.demos BoringModel", boring),
    Case("frozen_backbone", "hand", "ResNet classifier, backbone frozen", frozen_backbone),
    Case("adaln_zero_dit", "hand", "DiT-style adaLN-zero + ReZero, zero-init output", adaln_zero),
    Case("mixtral_top2", "hand", "Mixtral 4 experts top-2", mixtral),
    Case("qwen2_moe_top2", "hand", "Qwen2-MoE 8 experts top-2 + shared expert", qwen2_moe),
    Case("switch_top1", "hand", "Switch Transformers 8 experts top-1", lambda: switch()),
    Case("switch_32_experts", "hand", "Switch Transformers 32 experts top-1, 64 tokens a step",
         lambda: switch(experts=32)),
    Case("bf16_mixed_llama", "hand", "tiny Llama, precision bf16-mixed", bf16_mixed),
    Case("grad_accum_clip_gpt2", "hand", "GPT-2, accumulate_grad_batches=4, gradient_clip_val=1", grad_accumulation),
    Case("grad_ckpt_llama", "hand", "tiny Llama, gradient checkpointing", grad_checkpointing),
    Case("convnext_layer_scale", "hand", "ConvNeXt, layer scale 1e-6", convnext),
    Case("wav2vec2_layerdrop", "hand", "wav2vec2 audio classification, layerdrop 0.1", wav2vec2_layerdrop),
    Case("mobilenet_v2_advanced", "hand", "MobileNetV2, SGD 0.002, level=advanced", mobilenet_v2_advanced),
]


def all_cases() -> list[Case]:
    return HAND_CASES + auto_cases()


def case_named(name: str) -> Case:
    for case in all_cases():
        if case.name == name:
            return case
    raise KeyError(name)


# --- running one case --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """What one case under one setting did: trained (with its findings) or skipped with the reason."""

    status: str
    steps: int = 0
    seconds: float = 0.0
    reason: str = ""
    findings: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    result: Result | None = None
    probes: dict[str, Any] = dataclasses.field(default_factory=dict)  # what one-off probes read (batch_mixing)

    @property
    def quiet(self) -> bool:
        return self.status == "trained" and not self.findings

    def alarms(self) -> str:
        return "\n".join(f"{f['kind']}@{f.get('step')}: {f.get('message')}" for f in self.findings) or "none"


def summarize(finding: dict[str, Any]) -> dict[str, Any]:
    return {"kind": finding.get("kind"), "severity": finding.get("severity"), "step": finding.get("step"),
            "message": str(finding.get("message"))[:400]}


def fit_case(case: Case, setting: str, root: Path, steps: int = STEPS) -> Outcome:
    """Build ``case`` and train it ``steps`` optimizer steps under ``setting`` (a key of :data:`SETTINGS`)."""
    started = time.perf_counter()
    try:
        built = case.build()
    except Skip as skip:
        return Outcome("skipped", reason=str(skip), seconds=time.perf_counter() - started)
    except ImportError as error:
        return Outcome("skipped", reason=f"needs a package: {error}", seconds=time.perf_counter() - started)
    config = SETTINGS[setting](**built.config_overrides)
    options = dict(dict(limit_val_batches=0, num_sanity_val_steps=0), **built.trainer_options)
    trainer = make_trainer(root, debug_callbacks(config), max_steps=steps, **options)
    try:
        trainer.fit(built.module)
    except Exception as error:  # noqa: BLE001 - a model that cannot train here is recorded, not fatal
        return Outcome("train_failed", steps=trainer.global_step, seconds=time.perf_counter() - started,
                       reason=f"{type(error).__name__}: {str(error)[:200]}")
    directory = debug_dir(trainer)
    report = read_report(directory) if (directory / "report.json").exists() else {}
    result = Result(read_events(directory), report, time.perf_counter() - started, built.module)
    findings = [summarize(f) for f in result.serious()]
    findings += [{"kind": f"failed_check:{name}", "severity": "error", "step": None, "message": str(entry)[:400]}
                 for name, entry in report.get("failed_checks", {}).items()]
    probes = {"batch_mixing": report.get("sections", {}).get("activations", {}).get("batch_mixing")}
    return Outcome("trained", steps=trainer.global_step, seconds=time.perf_counter() - started, findings=findings,
                   result=result, probes=probes)


__all__ = ["Case", "Built", "Outcome", "Skip", "SETTINGS", "SERIOUS", "all_cases", "auto_cases", "case_named",
           "fit_case", "HAND_CASES"]
