"""A load leaves none of the checkpoint's file pages mapped in the process (docs/checkpoints.md,
"Loading"): each source tensor's pages are dropped after use together with what the kernel mapped
beside them (``SafetensorsFile.release(around=True)``, as check-ckpt drops them): the fault-around
window and, on Linux >= 6.18 with large page-cache folios (ext4, xfs), the whole folio, up to 2 MB.

Before, the load dropped only each tensor's own pages and the rest stayed mapped, counted in RSS, until
the files closed. Measured on this HF-written fixture (2 files, 296 tensors, 1.66 MB; Linux 6.18, ext4):
1.40 MB still mapped when the files closed; with 64 KB blocks around each tensor (check-ckpt's release
until now) 0.61 MB; now 0. On a saver-written 12-layer 66.5 MB checkpoint of 793 tensors: 14.0 MB
(peak RSS rise over the model 14.1 -> 0.9 MB). Mapped bytes are read per file from /proc/self/smaps.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import load_pretrained_state
from paddleformers_glm.checkpoint.safetensors_io import SafetensorsFile
from paddleformers_glm.testing import SpecModel

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "tiny" / "checkpoint"
pytestmark = [
    pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present"),
    pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps"),
]


def _mapped_bytes(path: str) -> int:
    """Resident bytes of this process's mappings of the file `path` (smaps' Rss lines)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = len(head) >= 6 and os.path.realpath(head[5]) == os.path.realpath(path)
            elif inside and head and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def test_a_load_leaves_no_file_pages_mapped(monkeypatch):
    held: dict[str, int] = {}
    close = SafetensorsFile.close

    def measured_close(self: SafetensorsFile) -> None:
        if self._mm is not None:
            held[os.path.basename(self.file)] = _mapped_bytes(self.file)
        close(self)

    monkeypatch.setattr(SafetensorsFile, "close", measured_close)
    cfg = GlmMoeDsaConfig.from_pretrained(FIXTURE)
    rep = load_pretrained_state(SpecModel(cfg, "float32"), FIXTURE, dtype="float32")
    assert len(rep.loaded) == 239 and len(held) == 2, (len(rep.loaded), held)
    assert sum(held.values()) == 0, held  # was 1.40 MB of the 1.66 MB files (0.61 MB with 64 KB blocks)
