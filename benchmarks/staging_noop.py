"""Re-staging an unchanged dataset of 100,000 files: hybridflow's stage_dataset against
`s5cmd sync`, both against the same `rclone serve s3` endpoint on 127.0.0.1 in the same run.

Both targets are first brought up to date (the files are placed in the server's folder, then each
tool runs once), so the measured runs have nothing to do. For hybridflow the benchmark counts
every request by type (botocore events) and the request body bytes sent, which must be 0.
Each tool runs --repeat times, interleaved; the best run counts.

    .venv/bin/python benchmarks/staging_noop.py [--count 100000] [--kib 4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import collections
import shutil

from s3bench import Bench, Measured, MiB, measure_here, write_files
from staging_catalogue import PUBLIC_CACHE, write_catalogue

from hybridflow.staging import StagingSettings, blob_key, stage_dataset
from hybridflow.storage.hashindex import HashIndex
from hybridflow.storage.sources import LocalFolderSource


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--kib", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with Bench() as bench:
        src = bench.root / "src" / "shots"
        total = write_files(src, args.count, args.kib * 1024)
        ds = LocalFolderSource(src)
        catalogue = write_catalogue(bench.root / "config", ds.name)
        settings = StagingSettings(pack="never")
        index = bench.root / "index.json"
        print(f"{args.count} x {args.kib} KiB = {total / MiB:.0f} MiB, unchanged, on {bench.endpoint}")

        # Bring both targets up to date without 2 x 100k PUTs: place the bytes in the server's folder.
        s5_bucket, hf_bucket = bench.bucket("s5"), bench.bucket("hf")
        hashes = {}
        for f in LocalFolderSource(src).scan(HashIndex(None), md5_max_size=1 << 30, workers=2):
            hashes[f.rel] = f.sha256
        for rel, sha in hashes.items():
            dst = bench.data / s5_bucket / "d" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dst)  # keeps mtime: s5cmd sync sees the object as not older
            blob = bench.data / hf_bucket / "cache" / blob_key(ds.name, sha)
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, blob)
        sync = bench.s5cmd("sync", f"{src}/*", f"s3://{s5_bucket}/d/")
        bench.run_tool("s5cmd sync (bring up to date)", sync, args.count, total)
        store = bench.store(hf_bucket, "cache")
        first = stage_dataset(ds, store, destination=PUBLIC_CACHE, catalogue=catalogue, run_key="warm",
                              settings=settings, index_path=index)
        assert first.bytes_copied == 0, "the prefilled blobs should have verified"

        calls: collections.Counter = collections.Counter()
        sent = [0]

        def on_send(request, **kwargs) -> None:
            calls[kwargs.get("event_name", "").rsplit(".", 1)[-1]] += 1
            if request.method in ("PUT", "POST"):
                sent[0] += int(request.headers.get("Content-Length") or 0)

        store.client.meta.events.register("before-send.s3", on_send)
        best: dict[str, Measured] = {}
        result = None
        for rep in range(args.repeat):
            m = bench.run_tool("s5cmd sync (nothing to do)", sync, args.count, total)
            best[m.tool] = min(best.get(m.tool, m), m, key=lambda x: x.seconds)
            calls.clear()
            sent[0] = 0
            m, result = measure_here(
                "hybridflow stage_dataset (nothing to do)",
                lambda rep=rep: stage_dataset(ds, store, destination=PUBLIC_CACHE, catalogue=catalogue,
                                              run_key=f"noop-{rep}", settings=settings, index_path=index),
                args.count, total,
            )
            best[m.tool] = min(best.get(m.tool, m), m, key=lambda x: x.seconds)
        s5, ours = best["s5cmd sync (nothing to do)"], best["hybridflow stage_dataset (nothing to do)"]
        print(f"{'tool':<44} {'seconds':>8} {'CPU s':>7}")
        for r in (s5, ours):
            print(f"{r.tool:<44} {r.seconds:>8.2f} {r.cpu_s:>7.2f}")
        print(f"\nhybridflow: {result.objects_copied} objects copied, {result.files_read} files read, "
              f"request body bytes sent: {sent[0]} (must be 0)")
        print("requests by type: " + ", ".join(f"{k} {v}" for k, v in sorted(calls.items())))
        print(f"time hybridflow / s5cmd sync: {ours.seconds / s5.seconds:.2f}x (target <= 1.2)")
        shutil.rmtree(src, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
