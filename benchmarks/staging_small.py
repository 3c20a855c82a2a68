"""Staging a small-file dataset: one object per file, and packed into tar shards, against
`s5cmd cp` (per file) and `rclone copy`, all to the same `rclone serve s3` endpoint on 127.0.0.1
in the same run. Then the training loader reads the staged samples back (every sample checked
against its SHA-256), from shards and from per-file objects.

Packed shards are also compared with tar + s5cmd over the same shards: the files grouped exactly as
stage_dataset groups them (``plan_shards`` on paths and sizes), then either ``tar -cf`` of every
shard (one per core at a time) followed by one ``s5cmd cp`` of the tar files, or ``tar -cf - |
s5cmd pipe`` per shard (--jobs shards at a time); both with a part size of at least the largest
shard, so each shard is one PutObject (s5cmd's requests are counted from its trace log). Reading
back, the loader's time (manifest, then every shard, every sample verified, in memory) is compared
with ``s5cmd cp`` of the tar files followed by ``tar -xf`` of each, and with ``s5cmd cat | tar
-xf -`` per shard, each shard into a folder of its own (extracted files are counted and sized, not
checked).

hybridflow's times are whole first stages (scan and hash with no index, verified uploads,
manifest). Client CPU is this process's CPU time (every thread) for hybridflow and the children's
rusage for the tools. Each tool runs --repeat times, interleaved; the best run counts.

    .venv/bin/python benchmarks/staging_small.py [--count 10000] [--kib 64] [--repeat 2] [--jobs 4] [--shard-mib N]
"""

from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from s3bench import Bench, Measured, MiB, measure_here, pipeline, table, write_files
from staging_catalogue import PUBLIC_CACHE, write_catalogue

from hybridflow.staging import StagingSettings, read_manifest, stage_dataset
from hybridflow.storage.reader import iter_samples
from hybridflow.storage.shards import Member, plan_shards
from hybridflow.storage.sources import LocalFolderSource

OURS_FILE = "hybridflow stage_dataset (per file)"
OURS_PACKED = "hybridflow stage_dataset (packed shards)"
OURS_READ = "hybridflow loader read-back (packed shards)"
TAR_CP = "tar, {jobs} at a time + s5cmd cp -p {part} (shards)"
TAR_PIPE = "tar | s5cmd pipe -p {part}, {jobs} shards at a time"
GET_CP = "s5cmd cp + tar -x, {jobs} at a time (shards)"
GET_PIPE = "s5cmd cat | tar -x, {jobs} shards at a time"


def read_back(label: str, store, manifest_key: str, nbytes: int) -> Measured:
    """Every sample of the staged version, verified, as the training loader reads it: the manifest,
    then :func:`hybridflow.storage.reader.iter_samples`. CPU is this process's."""
    def read() -> int:
        return sum(1 for _ in iter_samples(store, read_manifest(store, manifest_key), workers=16))

    m, n = measure_here(label, read, 0, nbytes)
    m.objects = n
    return m


def shard_lists(src: Path, folder: Path, settings: StagingSettings) -> tuple[list[Path], int]:
    """The files grouped as stage_dataset groups them into shards (plan_shards on paths and sizes),
    one list of paths per shard for ``tar -T``. Returns the lists and the largest shard's size bound."""
    members = [Member(p.relative_to(src).as_posix(), p.stat().st_size, "") for p in src.rglob("*") if p.is_file()]
    plans = plan_shards(members, target_size=settings.shard_target, max_size=settings.shard_max)
    folder.mkdir(parents=True, exist_ok=True)
    lists = []
    for i, plan in enumerate(plans):
        path = folder / f"shard-{i:05d}.txt"
        path.write_text("".join(m.path + "\n" for m in plan.members), encoding="utf-8")
        lists.append(path)
    return lists, max(plan.max_bytes for plan in plans)


@dataclass(frozen=True)
class TarRefs:
    """The tar + s5cmd references: the shard lists, s5cmd's part size, concurrency, and labels."""
    src: Path
    lists: list[Path]
    part: str  # MiB, at least the largest shard
    jobs: int  # shards in flight for the pipelines
    cores: int  # tar runs at a time for the tar files

    @property
    def tar_cp(self) -> str:
        return TAR_CP.format(jobs=self.cores, part=self.part)

    @property
    def tar_pipe(self) -> str:
        return TAR_PIPE.format(jobs=self.jobs, part=self.part)

    @property
    def get_cp(self) -> str:
        return GET_CP.format(jobs=self.cores)

    @property
    def get_pipe(self) -> str:
        return GET_PIPE.format(jobs=self.jobs)

    def keys(self, prefix: str) -> list[str]:
        return [f"{prefix}/{lst.stem}.tar" for lst in self.lists]


def check_extracted(folder: Path, count: int, nbytes: int) -> None:
    files = [p for p in folder.rglob("*") if p.is_file()]
    got = sum(p.stat().st_size for p in files)
    if len(files) != count or got != nbytes:
        raise RuntimeError(f"extracted {len(files)} files, {got} bytes; expected {count}, {nbytes}")


def tar_round(bench: Bench, t: TarRefs, count: int, total: int) -> list[Measured]:
    """One round of tar + s5cmd over the same shards as hybridflow's, up and back down: through tar
    files on disk and one s5cmd cp each way, then streamed per shard (no tar file either way)."""
    out_rows: list[Measured] = []
    # The same shards as tar files: written to disk, then uploaded with one s5cmd cp ...
    b = bench.bucket("tar")
    out = bench.root / "tars"
    out.mkdir()
    create = [["tar", "-cf", str(out / f"{lst.stem}.tar"), "-C", str(t.src), "-T", str(lst)] for lst in t.lists]
    upload = [bench.s5cmd("cp", "-p", t.part, f"{out}/*", f"s3://{b}/t/", trace=True)]
    out_rows.append(bench.run_steps(t.tar_cp, [(create, t.cores), (upload, 1)], count, total))
    shutil.rmtree(out)
    # ... and downloaded with one s5cmd cp, then extracted.
    dl, x = bench.root / "dl", bench.root / "x"
    x.mkdir()
    # Each shard into a folder of its own: GNU tar runs racing to create the same parent
    # folder fail.
    extract = [["tar", "-xf", str(dl / f"{lst.stem}.tar"), "-C", str(x), f"--one-top-level={lst.stem}"]
               for lst in t.lists]
    download = [bench.s5cmd("cp", f"s3://{b}/t/*", f"{dl}/")]
    out_rows.append(bench.run_steps(t.get_cp, [(download, 1), (extract, t.cores)], count, total))
    check_extracted(x, count, total)
    shutil.rmtree(dl)
    shutil.rmtree(x)
    bench.drop(b)

    # Streamed: no tar file on disk either way.
    b = bench.bucket("tarp")
    streams = [
        pipeline(["tar", "-cf", "-", "-C", str(t.src), "-T", str(lst)],
                 bench.s5cmd("pipe", "-p", t.part, key, trace=True))
        for lst, key in zip(t.lists, t.keys(f"s3://{b}/t"), strict=True)
    ]
    out_rows.append(bench.run_steps(t.tar_pipe, [(streams, t.jobs)], count, total))
    x.mkdir()
    streams = [pipeline(bench.s5cmd("cat", key), ["tar", "-xf", "-", "-C", str(x), f"--one-top-level={lst.stem}"])
               for lst, key in zip(t.lists, t.keys(f"s3://{b}/t"), strict=True)]
    out_rows.append(bench.run_steps(t.get_pipe, [(streams, t.jobs)], count, total))
    check_extracted(x, count, total)
    shutil.rmtree(x)
    bench.drop(b)
    return out_rows


def report(best: dict[str, Measured], reads: list[Measured], t: TarRefs) -> None:
    """Uploads against s5cmd per file and the tar references; read-back against s5cmd + tar -x."""
    uploads = [best[k] for k in best if k not in (OURS_READ, t.get_cp, t.get_pipe)]
    print(table(uploads, "s5cmd cp (per file)", per_object=True))
    s5 = best["s5cmd cp (per file)"]
    per_file, packed = best[OURS_FILE], best[OURS_PACKED]
    print(f"\nper file: hybridflow / s5cmd objects/s = {per_file.objects_s / s5.objects_s:.2f}x (target >= 0.5), "
          f"client CPU {per_file.cpu_ms_per_object:.2f} ms/object (target <= 2)")
    print(f"packed:   staging time hybridflow / s5cmd per-file = {packed.seconds / s5.seconds:.2f}x (target <= 0.5)")
    refs = [best[t.tar_cp], best[t.tar_pipe]]
    for r in refs:
        print(f"packed:   staging time hybridflow / {r.tool} = {packed.seconds / r.seconds:.2f}x; its S3 requests: "
              + ", ".join(f"{op} {n}" for op, n in sorted((r.requests or {}).items())))
    fairest = min(refs, key=lambda r: r.seconds)
    print(f"packed:   staging time hybridflow / fastest tar + s5cmd ({fairest.tool}) = "
          f"{packed.seconds / fairest.seconds:.2f}x (below 1 is faster)")

    print("\nreading the packed shards back (hybridflow: in memory, every sample checked against its SHA-256; "
          "tar: extracted to files, nothing checked):")
    downloads = [best[OURS_READ], best[t.get_cp], best[t.get_pipe]]
    print(table(downloads, t.get_cp, per_object=True))
    fastest = min(downloads[1:], key=lambda r: r.seconds)
    print(f"read-back time hybridflow / fastest s5cmd + tar -x ({fastest.tool}) = "
          f"{best[OURS_READ].seconds / fastest.seconds:.2f}x (below 1 is faster)")
    for r in [best[OURS_READ], *reads]:
        print(f"loader read-back, {r.tool.split('(')[-1].rstrip(')')}: {r.objects} samples verified in "
              f"{r.seconds:.2f}s ({r.objects_s:.0f} samples/s)")


def run(argv: list[str] | None = None) -> dict[str, Measured]:
    """Measure, print the figures, and return the best run of every tool configuration by label."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--kib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=4, help="shards in flight for the tar | s5cmd pipelines")
    parser.add_argument("--shard-mib", type=int, default=None,
                        help="shard target size (max: twice that); default: staging's own (32, max 64)")
    args = parser.parse_args(argv)
    with Bench() as bench:
        src = bench.root / "src" / "images"
        total = write_files(src, args.count, args.kib * 1024)
        ds = LocalFolderSource(src)
        catalogue = write_catalogue(bench.root / "config", ds.name)
        sizes = {} if args.shard_mib is None else {"shard_target": args.shard_mib * MiB,
                                                    "shard_max": 2 * args.shard_mib * MiB}
        settings = {pack: StagingSettings(pack=pack, **sizes) for pack in ("never", "always")}
        lists, shard_bound = shard_lists(src, bench.root / "lists", settings["always"])
        # A part size of at least the largest shard (s5cmd's least is 5 MiB): every shard one PutObject.
        tars = TarRefs(src, lists, part=str(max(5, -(-shard_bound // MiB))), jobs=args.jobs,
                       cores=os.cpu_count() or 2)
        print(f"{args.count} x {args.kib} KiB = {total / MiB:.0f} MiB on {bench.endpoint} (2 cores, loopback); "
              f"{len(lists)} shards")
        bench.warm_up(src)
        best: dict[str, Measured] = {}
        reads: list[Measured] = []

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
            for label, pack in ((OURS_FILE, "never"), (OURS_PACKED, "always")):
                b = bench.bucket("hf")
                store = bench.store(b, "cache")
                m, result = measure_here(
                    label,
                    lambda store=store, pack=pack, rep=rep: stage_dataset(
                        ds, store, destination=PUBLIC_CACHE, catalogue=catalogue, run_key=f"bench-{rep}",
                        settings=settings[pack],
                    ),
                    args.count, total,
                )
                assert result.objects_total == args.count
                keep(m)
                if pack == "always":
                    assert result.shards == len(lists), (result.shards, len(lists))
                    keep(read_back(OURS_READ, store, result.manifest_key, total))
                elif rep == args.repeat - 1:  # one GET per sample: once is enough
                    reads.append(read_back("per file", store, result.manifest_key, total))
                bench.drop(b)

            for m in tar_round(bench, tars, args.count, total):
                keep(m)

        report(best, reads, tars)
        shutil.rmtree(src, ignore_errors=True)
    return best


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
