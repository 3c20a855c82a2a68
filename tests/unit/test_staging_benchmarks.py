"""The staging benchmarks at a small size: every reference configuration runs against the loopback
endpoint, and the requests s5cmd sends are what each configuration's label says."""

from __future__ import annotations

import re

import pytest

from hybridflow.settings import REPO_ROOT

pytestmark = pytest.mark.s3


@pytest.fixture
def benchmarks(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    import staging_large
    import staging_small

    return staging_large, staging_small


def test_large_compares_with_s5cmd_whole_objects_and_in_parts(benchmarks, capsys) -> None:
    staging_large, _ = benchmarks
    # One 17 MiB object: whole with -p 17, two 16 MiB parts at high concurrency.
    best = staging_large.run(["--count", "1", "--mib", "17", "--repeat", "1"])
    whole = best["s5cmd cp -p 17 (whole objects)"]
    assert dict(whole.requests) == {"PutObject": 1}
    parts = best["s5cmd cp -c 16 -p 16 (high concurrency)"]
    assert parts.requests["CreateMultipartUpload"] == 1 and parts.requests["UploadPart"] == 2
    assert "PutObject" not in parts.requests
    assert best["s5cmd cp (defaults)"].requests == {"PutObject": 1}  # below its 50 MiB part size
    assert all(m.bytes == 17 * 2**20 and m.seconds > 0 for m in best.values())
    out = capsys.readouterr().out
    for label in best:
        assert label in out
    assert "hybridflow / best s5cmd configuration (" in out
    assert "hybridflow / s5cmd cp -p 17 (whole objects): " in out


def test_small_compares_packed_shards_with_tar_and_s5cmd(benchmarks, capsys) -> None:
    _, staging_small = benchmarks
    # 600 x 4 KiB in shards of about 1 MiB.
    best = staging_small.run(["--count", "600", "--kib", "4", "--repeat", "1", "--jobs", "2", "--shard-mib", "1"])
    tar_runs = {label: m for label, m in best.items() if label.startswith(("tar", "s5cmd cp +", "s5cmd cat"))}
    assert len(tar_runs) == 4, sorted(best)
    for label, m in tar_runs.items():
        assert m.objects == 600 and m.bytes == 600 * 4 * 1024 and m.seconds > 0, label
    out = capsys.readouterr().out
    shards = int(re.search(r"; (\d+) shards", out).group(1))
    assert shards >= 2
    uploads = [m for label, m in tar_runs.items() if label.startswith("tar")]
    assert [dict(m.requests) for m in uploads] == [{"PutObject": shards}] * 2  # each shard one PUT
    assert best[staging_small.OURS_READ].objects == 600
    for label in best:
        assert label in out
    assert "fastest tar + s5cmd (" in out and "fastest s5cmd + tar -x (" in out
