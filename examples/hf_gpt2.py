"""K-FAC on a Hugging Face ``transformers`` GPT-2 (the runs of configs/hf_gpt2*.yaml).

``GPT2LM`` wraps ``transformers.GPT2LMHeadModel`` built from a ``GPT2Config`` (random initial weights, nothing
is downloaded: ``HF_HUB_OFFLINE=1`` is set before ``transformers`` is imported). The model is GPT-2 as
``transformers`` writes it: attention and MLP projections are its own ``Conv1D`` (a transposed Linear), the
``lm_head`` is tied to the token embedding ``wte``, and the vocabulary is GPT-2's default 50257 tokens. K-FAC
preconditions every ``Conv1D`` (``c_attn``, ``c_proj``, ``c_fc``, ``mlp.c_proj``), the position embedding
``wpe`` and the vocabulary-sized head, whose G factor is kept diagonal (``max_factor_side``, default 4096);
the tied ``wte`` is preconditioned by the head's block.

The data are the byte tokens of Python's own standard-library sources (``StdlibTextDataModule``, vocabulary
256). They are fed to GPT-2 as they are: byte ``b`` is token id ``b``, so only ids 0..255 of the 50257 ever
occur, as inputs or targets. That is deliberate: the point of this workload is GPT-2's real, vocabulary-sized
tied head (its logits, softmax and 50257 x n_embd weight are most of a step's cost at this size), not a
tokenizer; the model has to learn that the other 50001 ids never come. Losses are nats per byte.

The training code is ``TinyGPT``'s (lightning_spdkfac/demo/textlm.py): the same per-token mean cross-entropy,
weight decay on the weight matrices only, AdamW (or SGD), linear warmup then cosine; only the network differs.

The entry point is the package's LightningCLI (``spdkfac``), so the ``kfac`` group configures the KFAC
callback from YAML or the command line::

    python examples/hf_gpt2.py fit --config configs/hf_gpt2.yaml          # AdamW + KFAC() at library defaults
    python examples/hf_gpt2.py fit --config configs/hf_gpt2_adamw.yaml    # AdamW alone (its tuned lr)
    python examples/hf_gpt2.py fit --config configs/hf_gpt2.yaml --kfac.damping=0.01

(``spdkfac fit --config configs/hf_gpt2.yaml`` from the repository root is the same run.) Time to tuned AdamW's
validation loss, 3 seeds: ``python benchmarks/time_to_accuracy.py --workloads gpt2 --budget 8 --optimizers adamw --kfac-rows none``
(docs/results/time-to-accuracy.md, "GPT-2 from transformers").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # build from a config, never fetch anything

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from lightning_spdkfac.demo.textlm import StdlibTextDataModule, TinyGPT  # noqa: E402

GPT2_VOCAB = 50257  # GPT2Config's default vocabulary; the byte corpus uses ids 0..255 of it


class GPT2LM(TinyGPT):
    """``transformers.GPT2LMHeadModel`` (from a ``GPT2Config``, random init) trained as ``TinyGPT`` is.

    Byte tokens are GPT-2 token ids below 256 (see the module docstring). Initial weights are GPT-2's own
    initialization, drawn from a generator seeded with ``init_seed`` (the global RNG is left as it was).

    Args:
        vocab_size: GPT-2's vocabulary (default 50257, the size of the tied head); must be at least 256.
        block_size: context length (``n_positions``: the size of ``wpe``).
        n_layer, n_head, n_embd: GPT-2's depth, heads and width; the MLP is ``4 * n_embd`` wide.
        dropout: ``resid_pdrop``, ``embd_pdrop`` and ``attn_pdrop`` (0: a deterministic run).
        tie_weights: ``tie_word_embeddings`` (the head shares ``wte``'s weight).
        The other arguments are ``TinyGPT``'s (optimizer, lr, weight decay, schedule, init seed, loss scale).
    """

    def __init__(
        self,
        vocab_size: int = GPT2_VOCAB,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 2,
        n_embd: int = 64,
        dropout: float = 0.0,
        tie_weights: bool = True,
        optimizer: Literal["adamw", "sgd"] = "adamw",
        lr: float = 1e-2,
        weight_decay: float = 0.1,
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        init_seed: int | None = 0,
        loss_scale: float = 1.0,
    ) -> None:
        if vocab_size < 256:
            raise ValueError(f"vocab_size must hold the 256 byte ids, got {vocab_size!r}")
        super().__init__(
            vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
            mlp_ratio=4, dropout=dropout, bias=True, tie_weights=tie_weights, attention="linear",
            optimizer=optimizer, lr=lr, weight_decay=weight_decay, momentum=momentum, betas=betas, eps=eps,
            warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, init_seed=init_seed, loss_scale=loss_scale,
        )

    def _build(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, mlp_ratio: int,
               dropout: float, bias: bool, tie_weights: bool, attention: Literal["mha", "linear"]) -> None:
        # Called by TinyGPT.__init__ under its init_seed generator; bias and attention have no GPT-2 counterpart
        # (GPT-2's Conv1D always has a bias, its head never).
        config = GPT2Config(
            vocab_size=vocab_size, n_positions=block_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            n_inner=mlp_ratio * n_embd, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
            tie_word_embeddings=tie_weights, use_cache=False,
        )
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for token ids ``(B, T)``."""
        if idx.shape[1] > self.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds the model's block_size {self.block_size}")
        return self.gpt(input_ids=idx, use_cache=False).logits


def bench_model(opt_name: str, lr: float, seed: int = 0) -> GPT2LM:
    """The model of configs/hf_gpt2*.yaml with ``opt_name`` at peak ``lr``, initial weights from ``seed``
    (benchmarks/time_to_accuracy.py's ``gpt2`` workload)."""
    return GPT2LM(optimizer=opt_name, lr=lr, init_seed=seed,
                  weight_decay=0.1 if opt_name == "adamw" else 5e-4)


def bench_data(seed: int) -> StdlibTextDataModule:
    """The data of configs/hf_gpt2*.yaml, training crops from ``seed``: 16 x 64 bytes a step, validation every
    10 steps on 32 fixed windows (2048 bytes)."""
    return StdlibTextDataModule(block_size=64, batch_size=16, max_bytes=2_000_000, seed=seed, val_fraction=0.1,
                                val_windows=32, batches_per_epoch=10)


if __name__ == "__main__":
    # `class_path: examples.hf_gpt2.GPT2LM` in the configs: the repository root must be importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lightning_spdkfac.cli import main

    sys.exit(main())
