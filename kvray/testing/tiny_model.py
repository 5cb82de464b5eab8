"""Build small checkpoints locally (no downloads) for tests, demos and benchmarks.

A byte-level BPE tokenizer trained on a fixed corpus and a ``LlamaForCausalLM`` (or, for
a hybrid-attention model, a ``Gemma3ForCausalLM``, a ``Qwen3NextForCausalLM`` or a
``NemotronHForCausalLM``; for latent attention, a ``DeepseekV2ForCausalLM``) with seeded
random weights, saved with ``save_pretrained``: vLLM
loads it like any model directory.
Building is deterministic, so two builds give the same outputs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A KV cache stores the keys and values of attention for every token.",
    "Prefill computes the cache once; decode reads it for every new token.",
    "Ray runs actors on every node of the cluster and schedules their tasks.",
    "Mooncake pools host memory across machines for large language models.",
] * 40


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A plain role-tagged template: the model is random, the template only has to exist."""


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    """Train the byte-level BPE tokenizer on the fixed corpus and save it to ``path``
    (``<s>``, ``</s>``, ``<unk>`` are ids 0, 1, 2; the chat template included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE  # so that /v1/chat/completions works too
    fast.save_pretrained(path)


def _save(path: Path, settings: dict[str, Any], make: Callable[[], Any]) -> Path:
    """The checkpoint ``make`` builds (a transformers model, its weights drawn after
    seeding torch with ``settings["seed"]``) and the tokenizer, saved to ``path`` with
    ``settings`` as its marker; nothing is built when the marker there equals
    ``settings``."""
    marker = path / "kvray_tiny_model.json"
    if marker.exists() and json.loads(marker.read_text()) == settings:
        return path
    import torch

    path.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(path, settings["vocab_size"])
    torch.manual_seed(settings["seed"])
    make().save_pretrained(path)
    marker.write_text(json.dumps(settings))
    return path


def build_tiny_llama(
    path: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """Write the model to ``path`` (skipped if a build with these settings is there)."""
    path = Path(path)
    settings = {
        "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_layers": num_layers,
        "num_heads": num_heads, "num_kv_heads": num_kv_heads,
        "max_positions": max_positions, "seed": seed, "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip

    def make() -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=hidden_size // num_heads,
            max_position_embeddings=max_positions,
            bos_token_id=0,
            eos_token_id=1,
            dtype="float32",
        )
        return LlamaForCausalLM(config)  # type: ignore[no-untyped-call]

    return _save(path, settings, make)


def build_tiny_gemma3(
    path: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    sliding_window: int = 64,
    full_every: int = 4,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """A hybrid-attention model: a ``Gemma3ForCausalLM`` whose every ``full_every``-th layer
    attends to the whole context and the others to the last ``sliding_window`` tokens, so
    that vLLM's hybrid KV cache manager makes several KV cache groups (the defaults: three
    sliding layers and one full, four groups). Written to ``path`` like
    :func:`build_tiny_llama` (skipped if a build with these settings is there)."""
    path = Path(path)
    settings = {
        "model": "gemma3", "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_layers": num_layers,
        "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "sliding_window": sliding_window, "full_every": full_every,
        "max_positions": max_positions, "seed": seed, "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip

    def make() -> Any:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        layer_types = [
            "full_attention" if (i + 1) % full_every == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
        config = Gemma3TextConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=sliding_window,
            layer_types=layer_types,
            max_position_embeddings=max_positions,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
            dtype="float32",
        )
        return Gemma3ForCausalLM(config)

    return _save(path, settings, make)


def build_tiny_qwen3_next(
    path: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    linear_num_key_heads: int = 1,
    linear_num_value_heads: int = 2,
    linear_head_dim: int = 128,
    linear_conv_kernel_dim: int = 4,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 128,
    full_every: int = 4,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """A hybrid linear-attention model: a ``Qwen3NextForCausalLM`` whose every
    ``full_every``-th layer is full attention and the others Gated DeltaNet (a recurrent
    state per request, vLLM's ``MambaSpec``), each layer with a small mixture of experts
    (vLLM's Qwen3-Next needs one), so that vLLM's hybrid KV cache manager makes state
    groups beside a full-attention group (the defaults: three linear-attention layers and
    one full). vLLM's CPU build runs it in
    bfloat16 only and needs ``linear_head_dim`` 128. Written to ``path`` like
    :func:`build_tiny_llama` (skipped if a build with these settings is there)."""
    path = Path(path)
    settings = {
        "model": "qwen3_next", "vocab_size": vocab_size, "hidden_size": hidden_size,
        "num_layers": num_layers, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
        "head_dim": head_dim, "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "linear_head_dim": linear_head_dim, "linear_conv_kernel_dim": linear_conv_kernel_dim,
        "num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": moe_intermediate_size, "full_every": full_every,
        "max_positions": max_positions, "seed": seed,
        "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip

    def make() -> Any:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        layer_types = [
            "full_attention" if (i + 1) % full_every == 0 else "linear_attention"
            for i in range(num_layers)
        ]
        config = Qwen3NextConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            linear_num_key_heads=linear_num_key_heads,
            linear_num_value_heads=linear_num_value_heads,
            linear_key_head_dim=linear_head_dim,
            linear_value_head_dim=linear_head_dim,
            linear_conv_kernel_dim=linear_conv_kernel_dim,
            layer_types=layer_types,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            shared_expert_intermediate_size=moe_intermediate_size,
            max_position_embeddings=max_positions,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
            dtype="bfloat16",
        )
        model = Qwen3NextForCausalLM(config)  # type: ignore[no-untyped-call]
        return model.bfloat16()

    return _save(path, settings, make)


def build_tiny_deepseek_mla(
    path: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_layers: int = 2,
    num_heads: int = 4,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    qk_nope_head_dim: int = 64,
    v_head_dim: int = 64,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """A latent-attention (MLA) model: a ``DeepseekV2ForCausalLM`` without mixture-of-experts
    layers (every layer dense) and without a query low-rank projection, whose KV cache is
    one latent per token (``kv_lora_rank`` + ``qk_rope_head_dim`` values, the same on every
    TP rank): one ``MLAAttentionSpec`` group. vLLM's CPU MLA needs that sum to be 576 (the
    defaults), and its AMX kernels bfloat16 weights: saved in bfloat16, run it so. Written
    to ``path`` like :func:`build_tiny_llama` (skipped if a build with these settings is
    there)."""
    path = Path(path)
    settings = {
        "model": "deepseek_mla", "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_layers": num_layers,
        "num_heads": num_heads, "kv_lora_rank": kv_lora_rank,
        "qk_rope_head_dim": qk_rope_head_dim, "qk_nope_head_dim": qk_nope_head_dim,
        "v_head_dim": v_head_dim, "max_positions": max_positions, "seed": seed,
        "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip

    def make() -> Any:
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            kv_lora_rank=kv_lora_rank,
            q_lora_rank=None,
            qk_rope_head_dim=qk_rope_head_dim,
            qk_nope_head_dim=qk_nope_head_dim,
            v_head_dim=v_head_dim,
            first_k_dense_replace=num_layers,  # every layer a dense MLP: no experts
            max_position_embeddings=max_positions,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
            dtype="bfloat16",
        )
        model = DeepseekV2ForCausalLM(config)  # type: ignore[no-untyped-call]
        return model.bfloat16()

    return _save(path, settings, make)


_NEMOTRON_H_LAYERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
"""Nemotron-H's layer pattern (its configs' ``hybrid_override_pattern``) to the layer types
of transformers' ``NemotronHConfig``."""


def build_tiny_nemotron_h(
    path: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 256,
    pattern: str = "M*M*",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    mamba_num_heads: int = 8,
    mamba_head_dim: int = 32,
    n_groups: int = 1,
    ssm_state_size: int = 64,
    conv_kernel: int = 4,
    intermediate_size: int = 512,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """A hybrid Mamba-2 model: a ``NemotronHForCausalLM`` whose layers follow ``pattern``
    (``M`` Mamba-2, ``*`` attention, ``-`` MLP; the default alternates Mamba-2 and
    attention), so that vLLM's hybrid KV cache manager makes a state group (vLLM's
    ``MambaSpec``) beside a full-attention group. Written to ``path`` like
    :func:`build_tiny_llama` (skipped if a build with these settings is there)."""
    path = Path(path)
    settings = {
        "model": "nemotron_h", "vocab_size": vocab_size, "hidden_size": hidden_size,
        "pattern": pattern, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
        "head_dim": head_dim, "mamba_num_heads": mamba_num_heads,
        "mamba_head_dim": mamba_head_dim, "n_groups": n_groups,
        "ssm_state_size": ssm_state_size, "conv_kernel": conv_kernel,
        "intermediate_size": intermediate_size, "max_positions": max_positions,
        "seed": seed, "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip

    def make() -> Any:
        from transformers import NemotronHConfig, NemotronHForCausalLM

        config = NemotronHConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            layers_block_type=[_NEMOTRON_H_LAYERS[c] for c in pattern],
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            mamba_num_heads=mamba_num_heads,
            mamba_head_dim=mamba_head_dim,
            n_groups=n_groups,
            ssm_state_size=ssm_state_size,
            conv_kernel=conv_kernel,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_positions,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
            dtype="float32",
        )
        return NemotronHForCausalLM(config)

    return _save(path, settings, make)


def build_prefill_bound_gemma3(path: str | Path) -> Path:
    """The hybrid-attention family's benchmark model: :func:`build_prefill_bound_llama`'s
    sizes, three of four layers attending to a 512-token sliding window (four KV cache
    groups under vLLM's hybrid allocator)."""
    return build_tiny_gemma3(
        path,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=4,
        num_heads=8,
        num_kv_heads=8,
        sliding_window=512,
        max_positions=8192,
    )


def build_prefill_bound_qwen3_next(path: str | Path) -> Path:
    """The linear-attention family's benchmark model: :func:`build_prefill_bound_llama`'s
    hidden size and depth, three of four layers Gated DeltaNet (state groups beside one
    full-attention group), a small mixture of experts; bfloat16."""
    return build_tiny_qwen3_next(
        path,
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=704,
        max_positions=8192,
    )


def build_prefill_bound_llama(path: str | Path) -> Path:
    """The model of the vLLM demo and the TTFT benchmark: big enough that prefill
    dominates TTFT on a CPU, small enough to build in seconds."""
    return build_tiny_llama(
        path,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=4,
        num_heads=8,
        num_kv_heads=8,
        max_positions=8192,
    )
