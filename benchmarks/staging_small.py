"""Staging a small-file dataset: one object per file, and packed into tar shards, against
`s5cmd cp` (per file) and `rclone copy`, all to the same `rclone serve s3` endpoint on 127.0.0.1
in the same run. Then the training loader reads the staged samples back (every sample checked
against its SHA-256), from shards and from per-file objects.

hybridflow's times are whole first stages (scan and hash with no index, verified uploads,
manifest). Client CPU is this process's CPU time (every thread) for hybridflow and the child's
rusage for the tools. Each tool runs --repeat times, interleaved; the best run counts.

    .venv/bin/python benchmarks/staging_small.py [--count 10000] [--kib 64] [--repeat 2]
"""

from __future__ import annotations

import argparse
import shutil
import time

from s3bench import Bench, Measured, MiB, measure_here, table, write_files
from staging_catalogue import PUBLIC_CACHE, write_catalogue

from hybridflow.staging import StagingSettings, read_manifest, stage_dataset
from hybridflow.storage.reader import iter_samples
from hybridflow.storage.sources import LocalFolderSource


def read_back(store, manifest_key: str) -> tuple[int, float]:
    """Every sample of the staged version, verified, as the training loader reads it
    (:func:`hybridflow.storage.reader.iter_samples`). Returns (samples, seconds)."""
    manifest = read_manifest(store, manifest_key)
    t0 = time.perf_counter()
    n = sum(1 for _ in iter_samples(store, manifest, workers=16))
    return n, time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--kib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with Bench() as bench:
        src = bench.root / "src" / "images"
        total = write_files(src, args.count, args.kib * 1024)
        ds = LocalFolderSource(src)
        catalogue = write_catalogue(bench.root / "config", ds.name)
        print(f"{args.count} x {args.kib} KiB = {total / MiB:.0f} MiB on {bench.endpoint} (2 cores, loopback)")
        bench.warm_up(src)
        best: dict[str, Measured] = {}
        reads: dict[str, tuple[int, float]] = {}

        def keep(m: Measured) -> None:
            if m.tool not in best or m.seconds < best[m.tool].seconds:
                best[m.tool] = m

        for rep in range(args.repeat):
            b = bench.bucket("s5")
            keep(bench.run_tool("s5cmd cp (per file)", bench.s5cmd("cp", f"{src}/*", f"s3://{b}/d/"), args.count, total))
            bench.drop(b)
            b = bench.bucket("rc")
            cmd = bench.rclone("copy", str(src), f"bench:{b}/d", "--transfers", "32", "--checkers", "16")
            keep(bench.run_tool("rclone copy --transfers 32 (per file)", cmd, args.count, total))
            bench.drop(b)
            for label, pack in (("hybridflow stage_dataset (per file)", "never"),
                                ("hybridflow stage_dataset (packed shards)", "always")):
                b = bench.bucket("hf")
                store = bench.store(b, "cache")
                m, result = measure_here(
                    label,
                    lambda store=store, pack=pack, rep=rep: stage_dataset(
                        ds, store, destination=PUBLIC_CACHE, catalogue=catalogue, run_key=f"bench-{rep}",
                        settings=StagingSettings(pack=pack),
                    ),
                    args.count, total,
                )
                assert result.objects_total == args.count
                keep(m)
                if rep == args.repeat - 1:
                    reads[label] = read_back(store, result.manifest_key)
                    if pack == "always":
                        print(f"packed into {result.shards} shards")
                bench.drop(b)
        rows = list(best.values())
        print(table(rows, "s5cmd cp (per file)", per_object=True))
        s5 = best["s5cmd cp (per file)"]
        per_file = best["hybridflow stage_dataset (per file)"]
        packed = best["hybridflow stage_dataset (packed shards)"]
        print(f"\nper file: hybridflow / s5cmd objects/s = {per_file.objects_s / s5.objects_s:.2f}x (target >= 0.5), "
              f"client CPU {per_file.cpu_ms_per_object:.2f} ms/object (target <= 2)")
        print(f"packed:   staging time hybridflow / s5cmd per-file = {packed.seconds / s5.seconds:.2f}x (target <= 0.5)")
        for label, (n, secs) in reads.items():
            print(f"loader read-back, {label.split('(')[1].rstrip(')')}: {n} samples verified in {secs:.2f}s "
                  f"({n / secs:.0f} samples/s)")
        shutil.rmtree(src, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
