"""A byte-level language model on Python's own standard-library sources: data module, TinyGPT, history.

The corpus is already on every machine that runs this package: the top-level ``*.py`` files of the
running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``), sorted by file name,
without the build-specific ``_sysconfigdata*`` module, concatenated byte for byte and cut at
``max_bytes``. Tokens are the raw bytes (vocabulary 256), so ``bytes(tokens)`` is the source text
again. The first ``1 - val_fraction`` of the stream is for training, the rest for validation (a
contiguous split by offset: no validation byte is ever inside a training crop). The selection
depends on the Python version; with CPython 3.11.7 the first 2 MB are 74 files, ``__future__.py``
to the start of ``ipaddress.py``, and the last 10% (validation) begin inside ``imaplib.py`` and
cover ``imghdr.py``, ``imp.py``, ``inspect.py`` and ``io.py``.

``TinyGPT`` is a small decoder-only transformer built the way people write one now: attention is
``nn.MultiheadAttention`` (K-FAC preconditions its q, k, v and output projections, docs/math.md
"Attention"), the output head shares its weight with the token ``nn.Embedding`` (preconditioned once, by
the head's block), and the loss is the plain per-token mean cross-entropy. ``attention="linear"`` writes
attention out as four ``nn.Linear`` (the same computation) and ``tie_weights=False`` unties the head.
"""

from __future__ import annotations

import math
import os
import sysconfig
import time
from pathlib import Path
from typing import Any, Literal, cast

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import AttributeDict
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .digits import EpochSeededSampler, JSONRecord

VOCAB_SIZE = 256  # byte-level tokens


# ----------------------------------------------------------------------------- the corpus
def stdlib_files(stdlib_dir: str | os.PathLike | None = None) -> list[Path]:
    """The corpus files: top-level ``*.py`` of the standard library, sorted by name.

    ``_sysconfigdata*.py`` is left out: it is generated at build time and differs between
    machines with the same Python version.
    """
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.glob("*.py") if p.is_file() and not p.name.startswith("_sysconfigdata")
    )
    if not files:
        raise FileNotFoundError(f"no *.py files in the standard library directory {root}")
    return files


def load_corpus(
    max_bytes: int | None = None, stdlib_dir: str | os.PathLike | None = None
) -> tuple[bytes, list[tuple[str, int]]]:
    """The concatenated bytes of :func:`stdlib_files`, cut at ``max_bytes`` (None: everything).

    Returns the bytes and, for every file that starts before the cut, ``(file name, offset)``.
    Only as many files are read as the cut needs.
    """
    chunks: list[bytes] = []
    index: list[tuple[str, int]] = []
    size = 0
    for path in stdlib_files(stdlib_dir):
        if max_bytes is not None and size >= max_bytes:
            break
        data = path.read_bytes()
        index.append((path.name, size))
        chunks.append(data)
        size += len(data)
    corpus = b"".join(chunks)
    if max_bytes is not None:
        corpus = corpus[:max_bytes]
    return corpus, index


def decode(tokens: torch.Tensor) -> str:
    """Byte tokens back to text (the corpus is UTF-8; a crop may cut a multi-byte character)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class _Windows(Dataset):
    """``(x, y)`` = ``tokens[o : o+T]``, ``tokens[o+1 : o+T+1]`` for a window start ``o``.

    Indexed by the start itself (``starts`` None: every valid start) or by position in ``starts``.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, starts: torch.Tensor | None = None) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.starts = starts

    def __len__(self) -> int:
        if self.starts is not None:
            return len(self.starts)
        return len(self.tokens) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        o = int(self.starts[i]) if self.starts is not None else int(i)
        chunk = self.tokens[o : o + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibTextDataModule(pl.LightningDataModule):
    """Byte-level next-token prediction on the standard library's sources (see the module docstring).

    Training batches are random crops of ``block_size + 1`` bytes of the training split, drawn with
    replacement from a generator seeded with ``seed`` (the same seed gives the same batches, epoch
    after epoch). Validation uses ``val_windows`` fixed windows evenly spaced over the validation
    split (all non-overlapping windows when None), in order.

    Args:
        block_size: context length T (the model's ``block_size`` must be at least this).
        batch_size: crops per training batch (also the validation batch size).
        max_bytes: corpus size: the first ``max_bytes`` bytes of the sorted files (None: all of them).
        seed: seed of the training crops (the corpus and the split do not depend on it).
        val_fraction: the last fraction of the corpus held out for validation, in (0, 1).
        val_windows: number of validation windows (None: every non-overlapping window).
        batches_per_epoch: training batches per epoch (an epoch is a number of random crops).
        num_workers: DataLoader workers (0 is fastest: the data is one in-memory tensor).
    """

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 32,
        max_bytes: int | None = 2_000_000,
        seed: int = 0,
        val_fraction: float = 0.1,
        val_windows: int | None = 256,
        batches_per_epoch: int = 100,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("block_size", block_size), ("batch_size", batch_size),
                            ("batches_per_epoch", batches_per_epoch)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")
        if val_windows is not None and val_windows <= 0:
            raise ValueError(f"val_windows must be a positive integer or None, got {val_windows!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.seed = seed
        self.val_fraction = val_fraction
        self.val_windows = val_windows
        self.batches_per_epoch = batches_per_epoch
        self.num_workers = num_workers
        self.files: list[tuple[str, int]] = []  # (file name, offset in the corpus)
        self.train_tokens: torch.Tensor | None = None  # uint8
        self.val_tokens: torch.Tensor | None = None
        self.val_starts: torch.Tensor | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_tokens is not None:
            return  # read and tokenized once
        corpus, self.files = load_corpus(self.max_bytes)
        tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        n_val = int(round(len(tokens) * self.val_fraction))
        n_train = len(tokens) - n_val
        if min(n_train, n_val) <= self.block_size:
            raise ValueError(
                f"the corpus ({len(tokens)} bytes) is too small for block_size={self.block_size} with "
                f"val_fraction={self.val_fraction}: raise max_bytes"
            )
        self.train_tokens, self.val_tokens = tokens[:n_train], tokens[n_train:]
        last = n_val - self.block_size - 1  # the last valid window start
        if self.val_windows is None:
            self.val_starts = torch.arange(0, last + 1, self.block_size)
        else:
            self.val_starts = torch.linspace(0, last, self.val_windows, dtype=torch.float64).round().long()

    def train_dataloader(self) -> DataLoader:
        # The crops of epoch e are the e-th stretch of one seeded stream, a function of (seed, e)
        # alone, so a fit resumed from a checkpoint continues the same sequence.
        assert self.train_tokens is not None  # read by setup(), which Lightning calls first
        data = _Windows(self.train_tokens, self.block_size)
        sampler = EpochSeededSampler(
            data, self.seed, replacement=True, num_samples=self.batches_per_epoch * self.batch_size
        )
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_tokens is not None  # read by setup(), which Lightning calls first
        data = _Windows(self.val_tokens, self.block_size, self.val_starts)
        return DataLoader(data, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The held-out split again, for ``spdkfac test``: the demo data has no third split (carving one
        out would change the training set of the published runs)."""
        return self.val_dataloader()


# ----------------------------------------------------------------------------- the model
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with four plain ``nn.Linear`` projections (q, k, v, out)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        self.k = nn.Linear(n_embd, n_embd, bias=bias)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.out = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.n_head

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, h, T, C/h)
            return t.view(B, T, h, C // h).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
            is_causal=True, dropout_p=self.dropout if self.training else 0.0,
        )
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class CausalMHA(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` (batch first) called as causal self-attention: ``attn(x)``.

    Only the call is wrapped (this class has no forward of its own, so K-FAC's attention routing applies to
    it as to any ``nn.MultiheadAttention``): a boolean upper-triangular mask with ``is_causal=True``, no
    attention weights returned.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__(n_embd, n_head, dropout=dropout, bias=bias, batch_first=True)

    def causal(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        return self(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``.

    ``attention``: ``"mha"`` an ``nn.MultiheadAttention`` (:class:`CausalMHA`), ``"linear"`` four plain
    ``nn.Linear`` projections (:class:`CausalSelfAttention`); the same computation.
    """

    def __init__(
        self, n_embd: int, n_head: int, mlp_ratio: int = 4, dropout: float = 0.0, bias: bool = True,
        attention: Literal["mha", "linear"] = "mha",
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn: CausalMHA | CausalSelfAttention = (
            CausalMHA(n_embd, n_head, dropout, bias) if attention == "mha"
            else CausalSelfAttention(n_embd, n_head, dropout, bias))
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc1 = nn.Linear(n_embd, mlp_ratio * n_embd, bias=bias)
        self.fc2 = nn.Linear(mlp_ratio * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a = self.attn.causal(h) if isinstance(self.attn, CausalMHA) else self.attn(h)
        x = x + self.drop(a)
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))

    def out_projection(self) -> nn.Linear:
        """The attention's output projection (initialized with the residual scaling)."""
        return self.attn.out_proj if isinstance(self.attn, CausalMHA) else self.attn.out


class TinyGPT(pl.LightningModule):
    """A small decoder-only transformer language model (GPT-style, pre-LN) for byte tokens.

    token + position embeddings -> ``n_layer`` blocks (causal self-attention, ``nn.MultiheadAttention`` by
    default; MLP of two nn.Linear with GELU) -> LayerNorm -> nn.Linear head tied to the token embedding.
    Weights are initialized as in GPT-2 (normal, std 0.02; residual output projections scaled by
    1/sqrt(2 n_layer)).

    ``train_loss`` (mean over the epoch's batches) and ``val_loss`` (mean over the validation
    windows) are cross-entropies in nats per token.

    Args:
        vocab_size: number of token ids (256 for bytes).
        block_size: maximum context length (size of the position embedding).
        n_layer: number of transformer blocks.
        n_head: attention heads per block.
        n_embd: model width.
        mlp_ratio: MLP hidden width in units of ``n_embd``.
        dropout: dropout on attention weights and residual branches (0: the run is deterministic
            given the seed).
        bias: biases in the Linear layers.
        tie_weights: share the head's weight with the token embedding (default). K-FAC then preconditions
            the shared weight by the head's block (one warning at setup names the embedding), whose factors
            describe the head's use of it, not the embedding's part of its gradient.
        attention: ``"mha"`` (default) ``nn.MultiheadAttention``; ``"linear"`` four ``nn.Linear`` q/k/v/out.
        optimizer: "adamw" or "sgd" (SGD with momentum, the usual base optimizer of K-FAC).
        lr: peak learning rate.
        weight_decay: decoupled (AdamW) or L2 (SGD) weight decay, applied to the weight matrices of
            the Linear layers and the embeddings, not to biases or LayerNorms.
        momentum: SGD momentum.
        nesterov: SGD with Nesterov momentum.
        betas: AdamW's betas.
        eps: AdamW's epsilon.
        warmup_steps: linear warmup of the lr over this many optimizer steps.
        min_lr_ratio: the cosine schedule ends at ``lr * min_lr_ratio`` after the last optimizer step
            of the run (``trainer.estimated_stepping_batches``).
        init_seed: seed of the initial weights, drawn from a generator of their own (the global RNG
            is left as it was), so the weights do not depend on what consumed random numbers
            before the model was built (LightningCLI builds the trainer's callbacks first, and
            ``KFAC`` draws a few numbers when it validates its arguments). None: the global RNG.
        loss_scale: the training loss that is back-propagated is ``loss_scale`` times the mean
            cross-entropy per token (the logged losses are not scaled). ``block_size`` makes it the
            sum over each sequence's tokens, averaged over the batch: K-FAC's G factor is then the
            mean over sequences of the per-sequence gradient outer products (docs/math.md), instead
            of ``1/block_size`` of that. K-FAC adds one ``damping`` to both factors, and with the mean
            loss G is far below A (at initialization in configs/transformer_lm.yaml the mean diagonal
            of G is 7e-10 to 8e-3 over the layers, that of A 0.01 to 1), so the damping swamps G; a
            loss scale s multiplies G by s^2 (64: the head's G goes from 6e-5 to 0.25). AdamW is
            invariant to it (up to ``eps``); with SGD it multiplies the effective lr of the parameters
            K-FAC does not precondition (embeddings, LayerNorms).
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = True,
        attention: Literal["mha", "linear"] = "mha",
        optimizer: Literal["adamw", "sgd"] = "adamw",
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        init_seed: int | None = 0,
        loss_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
        if not loss_scale > 0:
            raise ValueError(f"loss_scale must be > 0, got {loss_scale!r}")
        if attention not in ("mha", "linear"):
            raise ValueError(f"attention must be 'mha' or 'linear', got {attention!r}")
        self.save_hyperparameters()
        self.block_size = block_size
        with torch.random.fork_rng(devices=[], enabled=init_seed is not None):
            if init_seed is not None:
                torch.manual_seed(init_seed)
            self._build(vocab_size, block_size, n_layer, n_head, n_embd, mlp_ratio, dropout, bias,
                        tie_weights, attention)

    def _build(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, mlp_ratio: int,
               dropout: float, bias: bool, tie_weights: bool, attention: Literal["mha", "linear"]) -> None:
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        blocks = [Block(n_embd, n_head, mlp_ratio, dropout, bias, attention) for _ in range(n_layer)]
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for block in blocks:
            if isinstance(block.attn, CausalMHA):  # its packed q/k/v weight is a Parameter, not a Linear
                nn.init.normal_(block.attn.in_proj_weight, mean=0.0, std=0.02)
                if block.attn.in_proj_bias is not None:
                    nn.init.zeros_(block.attn.in_proj_bias)
            for proj in (block.out_projection(), block.fc2):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for token ids ``(B, T)``."""
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds the model's block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy (nats per token) of the next-token predictions of a batch."""
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(batch[0]), sync_dist=True)
        h = cast(AttributeDict, self.hparams)  # what save_hyperparameters() stores
        return loss * h.loss_scale if h.loss_scale != 1.0 else loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        # Every window has T tokens, so the mean over batches weighted by batch size is the mean per token.
        self.log("val_loss", self.loss(batch), on_epoch=True, batch_size=len(batch[0]), sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        # For ``spdkfac test``: mean cross-entropy per token on the data module's test windows.
        self.log("test_loss", self.loss(batch), on_epoch=True, batch_size=len(batch[0]), sync_dist=True)

    def param_groups(self) -> list[dict[str, Any]]:
        """Weight decay on the weight matrices (Linear, attention projections, embeddings); none on biases and
        LayerNorm parameters."""
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for p in self.parameters():  # each once (a tied weight too), in module order
            if p.requires_grad:  # matrices: Linear and embedding weights, attention's packed in_proj_weight
                (decay if p.dim() >= 2 else no_decay).append(p)
        return [
            {"params": decay, "weight_decay": cast(AttributeDict, self.hparams).weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def configure_optimizers(self) -> Any:
        h = cast(AttributeDict, self.hparams)  # what save_hyperparameters() stores
        opt: torch.optim.Optimizer
        if h.optimizer == "adamw":
            opt = torch.optim.AdamW(self.param_groups(), lr=h.lr, betas=tuple(h.betas), eps=h.eps)
        else:
            opt = torch.optim.SGD(self.param_groups(), lr=h.lr, momentum=h.momentum, nesterov=h.nesterov)
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("the cosine schedule needs a finite run: set trainer.max_steps or max_epochs")
        total = max(1, int(total))
        warmup, floor = h.warmup_steps, h.min_lr_ratio

        def factor(step: int) -> float:  # multiplier of the peak lr at optimizer step `step`
            if step < warmup:
                return (step + 1) / warmup
            t = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ----------------------------------------------------------------------------- a record of the run
class LossHistory(JSONRecord):
    """Write the validation loss after every validation run of ``fit`` (sanity check excluded) to JSON.

    The file (also kept in :attr:`results`)::

        {"final_val_loss": 1.52, "best_val_loss": 1.52, "steps": 600, "total_seconds": 210.3,
         "history": [{"step": 100, "epoch": 1, "val_loss": 2.41, "train_loss": 2.9, "seconds": 35.2}, ...]}

    ``step`` is the number of optimizer steps taken; ``train_loss`` the epoch mean when the epoch
    is complete (null for a validation run inside an epoch); ``seconds`` the wall time since fit start.

    Args:
        path: where to write the JSON (after every validation and at fit end), or None to keep it in
            memory only. A relative path is relative to ``trainer.default_root_dir``.
        monitor: the logged validation metric.
    """

    def __init__(self, path: str | None = "val_loss.json", monitor: str = "val_loss") -> None:
        super().__init__(path)
        self.monitor = monitor

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = time.perf_counter()
        self.results = {"monitor": self.monitor, "final_val_loss": None, "best_val_loss": None,
                        "steps": 0, "total_seconds": None, "history": []}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning validates at an epoch's end before this hook: fill in that epoch's mean train loss.
        value = trainer.callback_metrics.get("train_loss")
        history = self.results.get("history")
        if value is not None and history and history[-1]["epoch"] == trainer.current_epoch + 1:
            history[-1]["train_loss"] = float(value)
            self._write(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not self.results:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            raise KeyError(f"LossHistory: metric {self.monitor!r} was not logged; "
                           f"logged: {sorted(trainer.callback_metrics)}")
        loss = float(value)
        r = self.results
        r["history"].append({"step": trainer.global_step, "epoch": trainer.current_epoch + 1,
                             self.monitor: loss, "train_loss": None,
                             "seconds": round(time.perf_counter() - self._t0, 3)})
        r["final_val_loss"], r["steps"] = loss, trainer.global_step
        if r["best_val_loss"] is None or loss < r["best_val_loss"]:
            r["best_val_loss"] = loss
        self._write(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.results:
            return
        self.results["steps"] = trainer.global_step
        self.results["total_seconds"] = round(time.perf_counter() - self._t0, 3)
        self._write(trainer)
