"""Every skip CI may reach on purpose, in one list. Under CI=true any other skip fails
the run (tests/conftest.py): a dependency that breaks must not turn tests into skips.

Each entry: the start of the skip's reason, and why CI may skip it."""

from __future__ import annotations

INTENDED = {
    "needs a CUDA GPU": "CI has no GPU; the H200 runs them (benchmarks/gpu.sh checks)",
    "covered by the CUDA tests on GPU machines":
        "the interpreter would take minutes for what the CUDA tests cover",
    "needs root to run a client as another uid":
        "the lookup socket's uid check needs a second uid; CI runs as root, developers "
        "may not",
    "needs root to give a directory to another uid": "as above",
    "root may write anywhere": "the unwritable-path check cannot fail for root",
    "set G4KV_LMCACHE_OTHER": "needs an LMCache of another wire format, not installed",
    "set G4KV_MM_CPU=1": "the multimodal CPU case: about a minute of CI's 15 (measured "
                         "16:06 in all with it, 2026-12-05); tests/test_e2e_gpu_mm.py "
                         "runs it on the GPU",
}


def unexpected(reasons: list[str]) -> list[str]:
    """The skip reasons (as pytest reports them) that no entry of INTENDED starts."""
    return [r for r in reasons if not any(r.startswith(k) for k in INTENDED)]
