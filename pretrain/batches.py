"""A loader batch onto the training device without stalling the GPU.

The loader yields CPU tensors. Copied as they are, each is pageable memory, and a copy from pageable
memory waits for all the work already queued on the GPU; so would the model's own check of the token ids
on the GPU (it reads two values back). Either way the GPU then idles while the host launches the next
micro-batch's first kernels. Here the ids are checked on the host, where they are, and every tensor goes
through pinned memory, so the copy is queued like a kernel and the host stays ahead of the GPU.
"""
from __future__ import annotations

import torch
from torch import Tensor

from models.lm import check_input_values


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """x on `device`, copied asynchronously: a CPU tensor bound for a GPU goes through pinned memory (the
    caching host allocator keeps the pinned block until the copy has run)."""
    if x.device.type == "cpu" and device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device, non_blocking=True)


def device_batch(batch: dict, device: torch.device, vocab_size: int, segments: int = 1) -> dict:
    """The model's keyword arguments for a loader batch: ids and targets on `device`, and `check_ids` False
    when the batch was checked here (ids that arrive on the CPU, with their targets and document offsets;
    ids already on an accelerator are left to the model's check). Raises ValueError for ids or targets
    outside the vocabulary and for document offsets that do not describe the batch. `segments`: the
    sequence-parallel group size; each rank's ids are one segment of sequences its cu_seqlens describes whole."""
    ids = batch["input_ids"]
    checked = ids.device.type == "cpu" and all(
        t is None or t.device.type == "cpu" for t in (batch.get("targets"), batch.get("cu_seqlens")))
    if checked:
        check_input_values(ids, vocab_size, batch.get("targets"), batch.get("cu_seqlens"), segments)
    # document offsets stay where they are: the model moves them, and a sequence-parallel model reads them
    # on the host first (`pretrain.sequence_parallel`)
    return {"input_ids": to_device(ids, device), "targets": to_device(batch["targets"], device),
            "cu_seqlens": batch.get("cu_seqlens"), "check_ids": not checked}
