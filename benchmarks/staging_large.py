"""Staging large objects: hybridflow's stage_dataset against `s5cmd cp` and `rclone copy`, all
uploading the same files to the same `rclone serve s3` endpoint on 127.0.0.1 in the same run.
s5cmd runs with its defaults (50 MiB parts, 5 at a time per file), with a part size of at least the
object size (each file one PutObject, which spares the endpoint a second pass over a multipart
object's bytes to hash it), and at high concurrency; hybridflow is compared with each and with the
best of them. Every s5cmd run logs its requests, which are counted and printed.

hybridflow's time is a whole first stage: scanning and hashing (SHA-256, no index yet), verified
uploads, and the manifest. The endpoint's ceiling is the best any reference configuration reaches.
Each tool runs --repeat times, interleaved; the best run counts.

    .venv/bin/python benchmarks/staging_large.py [--count 8] [--mib 256] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import shutil

from s3bench import Bench, Measured, MiB, measure_here, table, write_files
from staging_catalogue import PUBLIC_CACHE, write_catalogue

from hybridflow.staging import StagingSettings, stage_dataset
from hybridflow.storage.sources import LocalFolderSource

OURS = "hybridflow stage_dataset (first stage)"


def run(argv: list[str] | None = None) -> dict[str, Measured]:
    """Measure, print the figures, and return the best run of every tool configuration by label."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    with Bench() as bench:
        src = bench.root / "src" / "weights"
        total = write_files(src, args.count, args.mib * MiB, per_dir=args.count)
        print(f"{args.count} x {args.mib} MiB = {total / MiB:.0f} MiB on {bench.endpoint} (2 cores, loopback)")
        bench.warm_up(src)
        catalogue = write_catalogue(bench.root / "config", src.name)
        best: dict[str, Measured] = {}

        def keep(m: Measured) -> None:
            if m.tool not in best or m.seconds < best[m.tool].seconds:
                best[m.tool] = m

        whole_part = str(max(5, args.mib))  # s5cmd's least part size is 5 MiB
        whole = f"s5cmd cp -p {whole_part} (whole objects)"
        s5cmd_configs = {
            "s5cmd cp (defaults)": (),
            # A part size at least the object size sends each file as one PutObject.
            whole: ("-p", whole_part),
            "s5cmd cp -c 16 -p 16 (high concurrency)": ("-c", "16", "-p", "16"),
        }
        for rep in range(args.repeat):
            for label, flags in s5cmd_configs.items():
                b = bench.bucket("s5")
                workers = ("--numworkers", "64") if "high concurrency" in label else ()
                cmd = bench.s5cmd(*workers, "cp", *flags, f"{src}/*", f"s3://{b}/w/", trace=True)
                keep(bench.run_tool(label, cmd, args.count, total))
                bench.drop(b)
            b = bench.bucket("rc")
            cmd = bench.rclone("copy", str(src), f"bench:{b}/w", "--transfers", "8", "--s3-upload-concurrency", "8",
                               "--s3-chunk-size", "16M", "--checkers", "8")
            keep(bench.run_tool("rclone copy --transfers 8 (high concurrency)", cmd, args.count, total))
            bench.drop(b)
            b = bench.bucket("hf")
            store = bench.store(b, "cache")
            ds = LocalFolderSource(src)
            m, result = measure_here(
                OURS,
                lambda ds=ds, store=store, rep=rep: stage_dataset(
                    ds, store, destination=PUBLIC_CACHE, catalogue=catalogue,
                    run_key=f"bench-{rep}", settings=StagingSettings(pack="never"),
                ),
                args.count, total,
            )
            assert result.bytes_copied == total and result.objects_copied == args.count
            keep(m)
            bench.drop(b)
        s5 = [best[k] for k in s5cmd_configs]
        fairest = max(s5, key=lambda r: r.mib_s)
        rows = list(best.values())
        print(table(rows, fairest.tool, per_object=False))
        print("\ns5cmd's S3 requests (best run): " + "; ".join(
            f"{r.tool}: " + ", ".join(f"{op} {n}" for op, n in sorted((r.requests or {}).items())) for r in s5))
        ours = best[OURS]
        for r in s5:
            print(f"hybridflow / {r.tool}: {ours.mib_s / r.mib_s:.2f}x bytes/s")
        print(f"hybridflow / best s5cmd configuration ({fairest.tool}): {ours.mib_s / fairest.mib_s:.2f}x bytes/s "
              "(target >= 1.0)")
        ceiling = max(r.mib_s for r in rows if r is not ours)
        print(f"endpoint ceiling (best reference configuration): {ceiling:.1f} MiB/s; "
              f"hybridflow reaches {ours.mib_s / ceiling:.0%} of it")
        shutil.rmtree(src, ignore_errors=True)
    return best


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
