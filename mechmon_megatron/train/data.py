"""Real text without a download: the bytes of the Python standard library's own source files.

Corpus: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``,
``test``, ``tests``, ``idlelib`` and ``__pycache__`` directories left out), in sorted order of
the relative path, concatenated until ``max_bytes``. Code, comments and docstrings: English
prose and Python, enough structure for a byte-level model to learn in a few hundred steps. The
same interpreter gives the same bytes, so runs are reproducible on one installation.

Tokens are bytes (vocabulary 256). The last ``val_fraction`` of the stream is held out. Batch
``i`` is ``global_batch_size`` windows of ``seq_length + 1`` bytes at offsets drawn from a
generator seeded by ``(seed, i)``, so the data position is the number of batches drawn: a
resumed run continues with exactly the batches it would have seen. Every rank builds the same
global batch and takes its data-parallel slice.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mechmon_megatron.config import require

__all__ = ["DataConfig", "TextData", "corpus_files", "read_corpus"]

_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "__pycache__"})


@dataclass
class DataConfig:
    """Where the tokens come from and how batches are drawn."""

    global_batch_size: int = 8
    """Sequences per step over all data-parallel ranks (divisible by the DP size)."""
    max_bytes: int = 4_000_000
    """Bytes of the standard library read into the corpus."""
    val_fraction: float = 0.05
    """Tail fraction of the byte stream held out for validation."""
    seed: int = 1234
    """Seed of the window offsets (batch ``i`` uses ``(seed, i)``)."""
    micro_batch_size: int = 0
    """Sequences per forward/backward on each rank: the rank's share of the batch is accumulated
    over ``global_batch_size / (dp * micro_batch_size)`` micro-batches (0: one micro-batch)."""
    eval_interval: int = 0
    """Compute the validation loss every this many steps (0: never)."""
    eval_batches: int = 2
    """Batches of ``global_batch_size`` windows in one validation pass."""

    def __post_init__(self) -> None:
        require(self.global_batch_size > 0, "global_batch_size", self.global_batch_size,
                 "an integer > 0")
        require(self.max_bytes >= 4096, "max_bytes", self.max_bytes, "an integer >= 4096")
        require(0 < self.val_fraction < 0.5, "val_fraction", self.val_fraction,
                 "a number in (0, 0.5)")
        require(self.micro_batch_size >= 0, "micro_batch_size", self.micro_batch_size,
                "an integer >= 0")
        require(self.eval_interval >= 0, "eval_interval", self.eval_interval, "an integer >= 0")
        require(self.eval_batches > 0, "eval_batches", self.eval_batches, "an integer > 0")


def corpus_files(root: str | Path | None = None) -> list[Path]:
    """The stdlib ``*.py`` files of the corpus, sorted by path relative to ``root``.

    Args:
        root: directory to scan; default the running interpreter's stdlib.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = [p for p in base.rglob("*.py")
             if not _SKIP_DIRS.intersection(p.relative_to(base).parts)]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def read_corpus(max_bytes: int, root: str | Path | None = None) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the concatenated corpus files as a ``[T]`` uint8 tensor.

    Raises:
        ValueError: the files hold fewer than 4096 bytes (no usable corpus).
    """
    chunks, total = [], 0
    for path in corpus_files(root):
        data = path.read_bytes()
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total < 4096:
        raise ValueError(f"the stdlib corpus under {root or 'the interpreter'} has only "
                         f"{total} bytes")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class TextData:
    """Batches of byte windows from the stdlib corpus, with a resumable position.

    Args:
        config: :class:`DataConfig`.
        seq_length: tokens per sample (each window holds ``seq_length + 1`` bytes).
        dp_rank: this rank's data-parallel index.
        dp_size: data-parallel size (divides ``global_batch_size``).
    """

    def __init__(self, config: DataConfig, seq_length: int, dp_rank: int = 0,
                 dp_size: int = 1) -> None:
        if config.global_batch_size % dp_size:
            raise ValueError(f"train.data.global_batch_size ({config.global_batch_size}) must be "
                             f"divisible by the data-parallel size ({dp_size})")
        per_rank, micro = config.global_batch_size // dp_size, config.micro_batch_size
        if micro and per_rank % micro:
            raise ValueError(f"train.data.micro_batch_size ({micro}) must divide each rank's "
                             f"share of the batch ({per_rank} = global_batch_size / {dp_size})")
        self.config = config
        self.seq_length = seq_length
        self.dp_rank, self.dp_size = dp_rank, dp_size
        stream_T = read_corpus(config.max_bytes)
        split = int(stream_T.numel() * (1 - config.val_fraction))
        self.train_T, self.val_T = stream_T[:split], stream_T[split:]
        if self.val_T.numel() <= seq_length + 1:
            raise ValueError(f"the validation split ({self.val_T.numel()} bytes) is shorter "
                             f"than one window; raise train.data.max_bytes or val_fraction")
        self.position = 0
        """Batches drawn so far (the resumable data position)."""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(tokens_BS, labels_BS)`` of the next training batch (int64)."""
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.position)
        self.position += 1
        high = self.train_T.numel() - self.seq_length - 1
        offsets_B = torch.randint(0, high, (self.config.global_batch_size,), generator=gen)
        return self._windows(self.train_T, self._local(offsets_B))

    def val_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slices of the fixed validation batches (evenly spaced windows)."""
        count = self.config.eval_batches * self.config.global_batch_size
        high = self.val_T.numel() - self.seq_length - 1
        offsets = torch.linspace(0, high, count).long().view(self.config.eval_batches, -1)
        return [self._windows(self.val_T, self._local(row)) for row in offsets]

    def state_dict(self) -> dict[str, Any]:
        """The data position and what it depends on (checked on load)."""
        return {"position": self.position, "seed": self.config.seed,
                "train_bytes": int(self.train_T.numel())}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue from a saved position.

        Raises:
            ValueError: the corpus or seed differs from the one the position refers to.
        """
        if (sd["seed"], sd["train_bytes"]) != (self.config.seed, self.train_T.numel()):
            raise ValueError(f"data state (seed {sd['seed']}, {sd['train_bytes']} train bytes) "
                             f"does not match this corpus (seed {self.config.seed}, "
                             f"{self.train_T.numel()} bytes)")
        self.position = int(sd["position"])

    def _local(self, offsets_B: torch.Tensor) -> torch.Tensor:
        per = offsets_B.numel() // self.dp_size
        return offsets_B[self.dp_rank * per:(self.dp_rank + 1) * per]

    def _windows(self, stream_T: torch.Tensor,
                 offsets_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index_BS = offsets_B[:, None] + torch.arange(self.seq_length + 1)[None, :]
        window_BS = stream_T[index_BS].long()
        return window_BS[:, :-1].contiguous(), window_BS[:, 1:].contiguous()
