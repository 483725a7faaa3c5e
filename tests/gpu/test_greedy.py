"""Greedy sampling in one kernel (``ops.greedy``): the first maximum of every row and its NaN flag, against
``torch.argmax`` / ``torch.isnan``, at batch sizes from 1 to 300 and vocabularies that do and do not fill their
chunks, with ties across chunks, all -inf rows and NaN rows; and ``sampler.greedy``, which the runner calls.

Needs CUDA; ``TRITON_INTERPRET=1`` runs the kernel on the CPU."""

from __future__ import annotations

import pytest
import torch
from triton_target import INTERPRET, triton_device  # noqa: E402

DEVICE = triton_device()

from ominix_worker.ops.greedy import greedy_argmax  # noqa: E402
from ominix_worker.ops.scratch import SCRATCH  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("vocab", [1000, 4096, 128256, 151936])
def test_first_maximum_and_nan_rows(rows: int, vocab: int) -> None:
    if INTERPRET and rows * vocab > 400_000:
        pytest.skip("too slow under the interpreter")
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, generator=gen)
    # Ties: the same maximum in several places, the earliest in a later chunk than position 0 for some rows.
    for r in range(0, rows, 3):
        top = logits[r].max() + 1.0
        logits[r, [vocab // 2, vocab - 1, vocab // 3]] = top
    if rows > 1:
        logits[1] = float("-inf")  # argmax of an all -inf row is 0
    nan_rows = [r for r in range(rows) if r % 5 == 4]
    for r in nan_rows:
        logits[r, (r * 131) % vocab] = float("nan")
    want_ids = logits.argmax(dim=-1)
    device_logits = logits.to(DEVICE)
    ids, bad = greedy_argmax(device_logits)
    assert ids.dtype == torch.int64 and bad.dtype == torch.bool
    assert bad.cpu().tolist() == [r in nan_rows for r in range(rows)]
    clean = [r for r in range(rows) if r not in nan_rows]
    assert ids.cpu()[clean].tolist() == want_ids[clean].tolist()
    # Each row's arrival counter is back at zero, and a second launch on them gives the same ids.
    assert not SCRATCH.counters(device_logits.device, rows)[:rows].any()
    again, _ = greedy_argmax(device_logits)
    assert again.cpu()[clean].tolist() == want_ids[clean].tolist()


def test_strided_rows_and_empty_batch() -> None:
    logits = torch.randn(4, 3000).to(DEVICE)
    view = logits[::2]  # rows 6000 apart, each contiguous
    ids, bad = greedy_argmax(view)
    assert ids.cpu().tolist() == view.cpu().argmax(dim=-1).tolist() and not bad.any()
    ids, bad = greedy_argmax(logits[:0])
    assert ids.shape == (0,) and bad.shape == (0,)
    with pytest.raises(ValueError, match="contiguous rows"):
        greedy_argmax(logits.t())


def test_sampler_greedy_matches_on_every_device() -> None:
    from ominix_worker.sampler import greedy

    logits = torch.randn(5, 2500)
    logits[2, 7] = float("nan")
    for device in {"cpu", DEVICE}:
        ids, bad = greedy(logits.to(device))
        assert bad.cpu().tolist() == [False, False, True, False, False]
        keep = [0, 1, 3, 4]
        assert ids.cpu()[keep].tolist() == logits.argmax(dim=-1)[keep].tolist()
