"""Where the reference data written elsewhere lives in this repository (tests/fixtures/reference,
origins and licences in its README): the one place tests and benchmarks resolve it."""

from __future__ import annotations

from pathlib import Path

REFERENCE = Path(__file__).resolve().parent / "fixtures" / "reference"
DCGM_SAMPLES = REFERENCE / "dcgm-exporter" / "samples"
PRICE_TABLE = REFERENCE / "pricing" / "gpu_pricing_ondemand_vs_spot.csv"
TRACE_DIR = REFERENCE / "traces" / "alibaba-cluster-trace-gpu-v2023"
