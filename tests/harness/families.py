"""Model families the zoo did not cover, each healthy, from tiny configs (no weights downloaded): a LoRA
adapter on a tiny Llama, ConvNeXt (layer scale 1e-6), a top-1 mixture of experts (Switch Transformers,
8 experts), wav2vec2 with LayerDrop, MobileNetV2 (SGD 0.002, judged at level ADVANCED).

Each is the kind of model whose healthy gradients look like a bug to a rule that reads one step against
fixed numbers: a zero-initialised partner (LoRA B), a tiny scale, experts and layers that skip steps, a
first update that is large relative to weights BatchNorm makes scale-invariant. ``transformers`` and
``peft`` are imported only when a family is built.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_debug import DebugConfig, debug_callbacks
from tests.harness.toolkit import debug_dir, make_trainer, read_events, read_report
from tests.harness.zoo import HEALTHY, DictDataset, HFModule, Plant, Result, _tokens


def lora_llama(seed: int = 0) -> HFModule:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                target_modules=["q_proj", "v_proj"]))
    tokens = _tokens(128, 16, 128, seed)
    return HFModule(model, DictDataset({"input_ids": tokens, "labels": tokens}), lr=1e-3)


def convnext(seed: int = 0) -> HFModule:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(seed)
    config = ConvNextConfig(num_channels=3, hidden_sizes=[8, 16, 32, 32], depths=[1, 1, 2, 1], image_size=32,
                            num_labels=4)
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(128, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 4, (128,), generator=generator)
    return HFModule(ConvNextForImageClassification(config), DictDataset({"pixel_values": images, "labels": labels}))


def switch_moe(seed: int = 0, plant: Plant = HEALTHY) -> HFModule:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    torch.manual_seed(seed)
    config = SwitchTransformersConfig(vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                      num_decoder_layers=2, num_experts=8, expert_capacity=64,
                                      num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    tokens = _tokens(128, 16, 128, seed)
    labels = _tokens(128, 8, 128, seed + 1)
    return HFModule(SwitchTransformersForConditionalGeneration(config),
                    DictDataset({"input_ids": tokens, "labels": labels}), plant=plant)


def wav2vec2_layerdrop(seed: int = 0) -> HFModule:
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    torch.manual_seed(seed)
    config = Wav2Vec2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                            conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_labels=3,
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=0.1)
    generator = torch.Generator().manual_seed(seed)
    audio = torch.randn(128, 1600, generator=generator)
    labels = torch.randint(0, 3, (128,), generator=generator)
    return HFModule(Wav2Vec2ForSequenceClassification(config), DictDataset({"input_values": audio, "labels": labels}))


def mobilenet_v2(seed: int = 0) -> HFModule:
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(seed)
    config = MobileNetV2Config(image_size=32, depth_multiplier=0.35, num_labels=4)
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(128, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 4, (128,), generator=generator)
    return HFModule(MobileNetV2ForImageClassification(config), DictDataset({"pixel_values": images, "labels": labels}),
                    lr=0.002, optimizer="sgd")


FAMILIES: dict[str, Callable[[], HFModule]] = {
    "lora": lora_llama, "convnext": convnext, "switch_moe": switch_moe, "wav2vec2_layerdrop": wav2vec2_layerdrop,
    "mobilenet_v2": mobilenet_v2,
}
LEVEL: dict[str, str] = {"mobilenet_v2": "advanced"}
"""The level each family is judged at beyond the default (update ratios are measured from ADVANCED)."""


def every_step(**overrides: Any) -> DebugConfig:
    """Every check on every optimizer step, nothing printed or drawn."""
    options: dict[str, Any] = dict(anomaly_check_frequency=1, gradient_checking_frequency=1,
                                   memory_profiling_frequency=1, performance_profiling_frequency=1,
                                   print_summary=False, save_plots=False)
    options.update(overrides)
    return DebugConfig(**options)


def train(family: str, config: DebugConfig, root: Path, max_steps: int, module: HFModule | None = None) -> Result:
    """Train ``family`` (or ``module``) on CPU under every callback ``config`` enables and read back what the
    run wrote."""
    module = module if module is not None else FAMILIES[family]()
    trainer = make_trainer(root, debug_callbacks(config), max_steps=max_steps, limit_val_batches=0)
    trainer.fit(module)
    directory = debug_dir(trainer)
    return Result(read_events(directory), read_report(directory), 0.0, module)
