"""The facts of the machine a benchmark ran on, printed beside every figure it quotes.

A ratio measured on one machine is read on another: what could make it move goes beside it. The
CPU's model, vector extensions and clock; its cores and the threads Numba runs on; the
transparent huge pages setting (a large array's first touch faults 4 KiB pages or 2 MiB ones);
the BLAS libraries and the core type their kernels were chosen for; the versions of Python,
NumPy and Numba. Each benchmark adds its own ceilings (SGEMM, copy bandwidth, the link), measured
in the same run.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

#: the vector extensions that decide which kernels a CPU runs
VECTOR_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile")


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


def cpu_flags() -> frozenset[str]:
    """The first processor's feature flags (/proc/cpuinfo's `flags`; empty where there is none)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _selected(setting: str | None) -> str | None:
    """The bracketed choice of a sysfs setting ("always [madvise] never" -> "madvise")."""
    if setting and "[" in setting:
        return setting.split("[", 1)[1].split("]", 1)[0]
    return setting


#: the last-level cache assumed where the system does not say (a server CPU's L3 is 16-64 MiB)
FALLBACK_LAST_LEVEL_CACHE_BYTES = 32 << 20


#: where Linux lists the first CPU's caches, one `indexN` folder each
CPU0_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(caches: Path = CPU0_CACHES) -> int:
    """The largest of the caches listed in `caches` (sysfs: "32768K"), else
    `FALLBACK_LAST_LEVEL_CACHE_BYTES`."""
    sizes = []
    for index in caches.glob("index*"):
        text = _read(str(index / "size"))
        if text and text[:-1].isdigit():
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper())
            if unit:
                sizes.append(int(text[:-1]) * unit)
        elif text and text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=FALLBACK_LAST_LEVEL_CACHE_BYTES)


def blas_in_use() -> dict[str, str]:
    """The BLAS libraries in the process, each with the core type its kernels were chosen for:
    "kernels", SciPy's, which Numba's BLAS calls would reach (no kernel makes one: the filter and
    linear products run on `runtime.kernels.microkernel`), and "ceiling", NumPy's.

    OpenBLAS picks its kernels by CPU, or as `OPENBLAS_CORETYPE` says: AVX2 ("Haswell") kernels
    on an AVX-512 machine run the in-process ceiling below what the machine can do."""
    import scipy.linalg  # noqa: F401  (loads SciPy's BLAS, so that it is listed)
    from threadpoolctl import threadpool_info

    found = {"kernels": "unknown", "ceiling": "unknown"}
    for info in threadpool_info():
        if info.get("user_api") != "blas":
            continue
        package = info.get("filepath", "").replace("\\", "/").split("/")[-2]
        text = f"{info['internal_api']} {info.get('version')}, {info.get('architecture')} kernels"
        if package.startswith("scipy"):
            found["kernels"] = text
        elif package.startswith("numpy"):
            found["ceiling"] = text
    return found


def machine_facts() -> dict:
    """This machine's facts, as a benchmark's JSON holds them."""
    import numba
    import numpy

    info = _cpuinfo()
    flags = cpu_flags()
    max_khz = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    return {
        "cpu": cpu_model(),
        "vector_flags": [f for f in VECTOR_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "clock_mhz": float(info["cpu MHz"]) if "cpu MHz" in info else None,
        "max_clock_mhz": int(max_khz) / 1000 if max_khz else None,
        "numba_threads": numba.config.NUMBA_NUM_THREADS,
        "last_level_cache_mib": last_level_cache_bytes() / 2**20,
        "transparent_hugepages": _selected(_read("/sys/kernel/mm/transparent_hugepage/enabled")),
        "transparent_hugepages_defrag": _selected(
            _read("/sys/kernel/mm/transparent_hugepage/defrag")
        ),
        "blas": blas_in_use(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "numba": numba.__version__,
    }


def describe(facts: dict) -> str:
    """`facts` in two lines, for the head of a benchmark's report."""
    clock = f", {facts['clock_mhz']:.0f} MHz" if facts.get("clock_mhz") else ""
    return (
        f"machine: {facts['cpu']} ({' '.join(facts['vector_flags']) or 'no AVX'}), "
        f"{facts['cores']} cores{clock}, {facts['numba_threads']} Numba threads"
        + (
            f", {facts['last_level_cache_mib']:g} MiB last-level cache"
            if "last_level_cache_mib" in facts
            else ""
        )
        + "; "
        f"transparent huge pages {facts['transparent_hugepages']} "
        f"(defrag {facts['transparent_hugepages_defrag']})\n"
        f"software: BLAS {facts['blas']['ceiling']} (NumPy), {facts['blas']['kernels']} (SciPy); "
        f"Python {facts['python']}, NumPy {facts['numpy']}, Numba {facts['numba']}"
    )
