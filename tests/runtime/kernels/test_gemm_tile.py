"""The emitted tile's vector width, as Numba's target gives it."""

from runtime.kernels import gemm_tile


def test_vector_width_follows_numbas_target(monkeypatch):
    monkeypatch.setattr(gemm_tile.numba.config, "CPU_FEATURES", "+avx,+avx2,+fma")
    assert gemm_tile._target_vector_bytes() == 32
    monkeypatch.setattr(gemm_tile.numba.config, "CPU_FEATURES", "+avx512f,+avx2")
    assert gemm_tile._target_vector_bytes() == 64
    monkeypatch.setattr(gemm_tile.numba.config, "CPU_FEATURES", "")
    monkeypatch.setattr(gemm_tile.numba.config, "CPU_NAME", "generic")
    assert gemm_tile._target_vector_bytes() == 16
