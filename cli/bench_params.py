"""``staleflow bench params``: the command line of the parameter server benchmark; the measuring
lives in the library beside the transports it measures (``staleflow.transports.bench``, which
describes what is measured)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress
from rich.table import Table

from staleflow.cli.common import console, emit_results, fail
from staleflow.transports.bench import RING_TENSORS, TARGETS, run_params_bench
from staleflow.transports.checksums import VERIFY_MODES
from staleflow.transports.errors import FormatError
from staleflow.transports.tables import model_tensor_table

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"size {text!r}: use e.g. 512MB, 1GB, 4GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("params")
    def params_cmd(
        sizes: Annotated[str | None, typer.Option(help="synthetic state-dict sizes, comma-separated (default 1GB,4GB,16GB; "
                                                       "none with --model)")] = None,
        model: Annotated[list[str] | None, typer.Option(help="a model directory or config.json: push and pull its real tensor "
                                                             "table (shapes from transformers on the meta device; repeatable)")] = None,
        dtype: Annotated[str | None, typer.Option(help="the real tables' floating dtype: bf16, fp16, fp32 (default: the config's)")] = None,
        synthetic: Annotated[bool, typer.Option(help="with --model: also the synthetic table of each model's bytes, side by "
                                                     "side")] = True,
        device: Annotated[str, typer.Option(help="cpu: shards and parameters in host memory; cuda: ranks hold their shares "
                                                 "on the GPU, instances load into GPU tensors (legs and copy bound reported)")] = "cpu",
        transports: Annotated[str, typer.Option(help="comma-separated: shm, http, nixl")] = "shm,http",
        verify: Annotated[str, typer.Option(help="how pulls verify, comma-separated, each measured in the same run: auto "
                                                 "(checksums; over shm the slot's generation stamp), checksum (every byte "
                                                 "hashed), none")] = "auto",
        ranks: Annotated[str, typer.Option(help="trainer ranks pushing at once, comma-separated")] = "1,2,4",
        instances: Annotated[str | None, typer.Option(help="instances pulling at once, comma-separated (default 1,2,4; "
                                                           "with --sources 1,4,8,16)")] = None,
        sources: Annotated[str | None, typer.Option(help="bursts instead of push/pull cells: where the instances pull a "
                                                         "version from, comma-separated (ps: the parameter server's "
                                                         "fan-out; ros: holders, each on an emulated host of its own; "
                                                         "ros-shm: holders on this host, over shared memory; "
                                                         "ros-nixl: the same over NIXL); each burst count, an elastic "
                                                         "join, a holder killed mid-burst and the trainer's push "
                                                         "during a join, side by side")] = None,
        cases: Annotated[str | None, typer.Option(help="with --sources: which cases, comma-separated (burst, elastic_join, "
                                                       "holder_killed, push_during_join; default all)")] = None,
        link_gbps: Annotated[float | None, typer.Option("--link-gbps", help="egress limit of every server of the bench, "
                                                                            "in Gbit/s (a token bucket per endpoint: "
                                                                            "emulates a NIC; default: none)")] = None,
        plot: Annotated[Path | None, typer.Option(help="with --sources: also plot burst seconds against instances "
                                                       "(PNG)")] = None,
        repeats: Annotated[int, typer.Option(help="versions per measurement (median reported)")] = 3,
        chunk_mb: Annotated[int, typer.Option("--chunk-mb", help="PS chunk size in MiB")] = 64,
        pool: Annotated[str, typer.Option(help="auto: when a size does not fit in memory, ranks and instances hold "
                                               f"{RING_TENSORS} shared buffers of same-shaped tensors (the PS still holds "
                                               "every byte) and nothing is persisted; on; off")] = "auto",
        persist: Annotated[bool, typer.Option(help="the PS persists each version; its copy to disk runs while the "
                                                   "instances pull")] = True,
        side_by_side: Annotated[bool, typer.Option(help="instead of pushes and pulls by processes: memcpy and one shm pull "
                                                        "per --verify mode, interleaved in this process (--repeats rounds), "
                                                        "wall and CPU time against a PS in its own process")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
        output: Annotated[Path | None, typer.Option(help="also write the JSON here")] = None,
    ) -> None:
        """Push (N ranks at once), visibility, pull (K instances at once) and end-to-end version
        latency per state-dict size, next to memcpy of the same bytes; with --sources, bursts of
        instances pulling one version at once from each source."""
        if link_gbps is not None and not link_gbps > 0:
            raise fail(f"--link-gbps {link_gbps:g}: give a positive speed in Gbit/s, e.g. --link-gbps 1")
        if sources is not None:
            _bursts(sources, sizes, instances or "1,4,8,16", link_gbps, repeats, chunk_mb, plot, as_json, output, cases)
            return
        instances = instances or "1,2,4"
        if sizes is None:
            sizes = "" if model else "1GB,4GB,16GB"
        if device not in ("cpu", "cuda"):
            raise fail(f"--device {device!r}: choose cpu or cuda")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise fail("--device cuda: torch sees no CUDA device here", "run on a GPU host or use --device cpu")
        try:
            tables = [(model_label(m), model_tensor_table(m, dtype)) for m in model or []]
        except FormatError as exc:
            raise fail(str(exc), "give a directory holding config.json, or the config.json itself") from None
        try:
            size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
            rank_list = [int(r) for r in ranks.split(",") if r.strip()]
            instance_list = [int(k) for k in instances.split(",") if k.strip()]
        except ValueError as exc:
            raise fail(str(exc)) from None
        chosen = [t.strip() for t in transports.split(",") if t.strip()]
        unknown = set(chosen) - {"shm", "http", "nixl"}
        if unknown or not chosen:
            raise fail(f"transports {sorted(unknown) or chosen}: choose from shm, http, nixl")
        if "nixl" in chosen:
            from staleflow.transports.nixl import nixl_available

            available, reason = nixl_available()
            if not available:
                raise fail(reason, "drop nixl from --transports or install it")
        verify_list = [v.strip() for v in verify.split(",") if v.strip()]
        if not verify_list or set(verify_list) - set(VERIFY_MODES):
            raise fail(f"--verify {verify!r}: choose from {', '.join(VERIFY_MODES)}, comma-separated")
        if not rank_list or not instance_list or min(rank_list + instance_list) < 1:
            raise fail("--ranks and --instances need positive counts")
        if pool not in ("auto", "on", "off"):
            raise fail(f"--pool {pool!r}: choose from auto, on, off")
        if not size_list and not tables:
            raise fail("nothing to measure: give --sizes or --model")
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("parameter server benchmark", total=None)
            results = run_params_bench(size_list, chosen, rank_list, instance_list, repeats, chunk_mb, pool, tables, synthetic,
                                       "host" if device == "cpu" else device,
                                       planned=lambda steps: progress.update(task, total=steps),
                                       advance=lambda steps: progress.advance(task, steps), verify_modes=verify_list,
                                       side_by_side=side_by_side, persist=persist, link_gbps=link_gbps)
        emit_results(results, output, as_json, _print)


def _bursts(sources: str, sizes: str | None, instances: str, link_gbps: float | None, repeats: int, chunk_mb: int,
            plot: Path | None, as_json: bool, output: Path | None, cases: str | None = None) -> None:
    """``bench params --sources``: bursts per source (``staleflow.transports.burst``)."""
    from staleflow.transports import burst_ros  # noqa: F401 - registers the ros source
    from staleflow.transports.burst import BURST, CASES, DEFAULT_BURST_BYTES, plot_bursts, run_burst_bench, unknown_sources

    case_list = [c.strip() for c in (cases or ",".join(CASES)).split(",") if c.strip()]
    if not case_list or set(case_list) - set(CASES):
        raise fail(f"--cases {cases!r}: choose from {', '.join(CASES)}, comma-separated")
    if plot is not None and BURST not in case_list:
        raise fail("--plot draws the bursts: add burst to --cases, or drop --plot")

    names = [s.strip() for s in sources.split(",") if s.strip()]
    if not names:
        raise fail("--sources needs at least one source, e.g. --sources ps")
    problems = unknown_sources(names)
    if problems:
        from staleflow.transports.burst import BURST_SOURCES

        raise fail("; ".join(problems), f"choose from {', '.join(BURST_SOURCES)}")
    try:
        size_list = [parse_size(s) for s in (sizes or "").split(",") if s.strip()] or [DEFAULT_BURST_BYTES]
        counts = sorted({int(k) for k in instances.split(",") if k.strip()})
    except ValueError as exc:
        raise fail(str(exc)) from None
    if len(size_list) != 1:
        raise fail("--sources measures one version size at a time: give one --sizes value, e.g. --sizes 128MB")
    if not counts or counts[0] < 1 or repeats < 1:
        raise fail("--instances needs positive counts and --repeats at least 1")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"bursts from {', '.join(names)}", total=None)
        try:
            results = run_burst_bench(names, counts, size_list[0], link_gbps, repeats, chunk_mb,
                                      planned=lambda steps: progress.update(task, total=steps),
                                      advance=lambda steps: progress.advance(task, steps), cases=case_list)
        except RuntimeError as exc:  # a worker that died, or bytes that are not the version's
            raise fail(f"the burst bench failed: {exc}") from None
    if plot is not None:
        plot_bursts(results, plot)
    emit_results(results, output, as_json, _print_bursts)


def _print_bursts(results: dict) -> None:
    link = f"{results['link_gbps']:g} Gbit/s per endpoint" if results.get("link_gbps") else "no egress limit"
    table = Table(title=f"Bursts: instances pulling one {results['bytes'] / 1e6:.0f} MB version at once over http "
                        f"({results['chunk_mb']} MiB chunks, {link}); median of {results['repeats']}; load average "
                        f"{results['load_average_before']:.1f} -> {results['load_average_after']:.1f}")
    for column in ("source", "case", "instances", "burst s", "vs one pull", "vs one version's wire time", "mean pull s",
                   "delivered GB/s", "links' worth", "join s"):
        table.add_column(column, justify="left" if column in ("source", "case") else "right")
    for c in results["cells"]:
        table.add_row(c["source"], c["kind"].replace("_", " "), str(c["instances"]), f"{c['burst_seconds']:.3f}",
                      f"{c['vs_single']:.2f}" if c["vs_single"] is not None else "-",
                      f"{c['vs_wire_time']:.2f}" if "vs_wire_time" in c else "-",
                      f"{c['pull_seconds_mean']:.3f}", f"{c['delivered_gb_per_s']:.3f}",
                      f"{c['links_worth']:.2f}" if "links_worth" in c else "-",
                      f"{c['join_seconds']:.3f}" if "join_seconds" in c else "-")
    if results["cells"]:
        console.print(table)
    if results["pushes"]:
        _print_pushes(results)
    for skipped in results["skipped"]:
        console.print(f"  [yellow]{skipped['source']}: {skipped['kind'].replace('_', ' ')} not run: {skipped['why']}[/]")


def _print_pushes(results: dict) -> None:
    table = Table(title=f"The trainer's push of a new {results['bytes'] / 1e6:.0f} MB version over http, alone and while "
                        "one more instance pulls the previous one (an elastic join); median of "
                        f"{results['repeats']}")
    for column in ("source", "instances holding it", "push s alone (runs)", "push s during the join (runs)",
                   "during / alone", "joiner's pull s", "push within the join"):
        table.add_column(column, justify="left" if column == "source" else "right")
    for p in results["pushes"]:
        table.add_row(p["source"], str(p["instances"]), f"{p['push_seconds']:.3f} ({_span(p['push_seconds_all'])})",
                      f"{p['push_seconds_with_join']:.3f} ({_span(p['push_seconds_with_join_all'])})",
                      f"{p['push_ratio']:.2f}", f"{p['join_seconds']:.3f}", f"{p['join_overlap']:.0%}")
    console.print(table)


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def _print(results: dict) -> None:
    for side in results.get("side_by_side", []):
        table = Table(title=f"memcpy and shm pulls of {side['table']} ({side['tensors']} tensors, {side['bytes'] / 1e9:.2f} GB), "
                            f"interleaved, median of {side['rounds']} rounds; load average {side['load_average_before']:.1f} "
                            f"-> {side['load_average_after']:.1f}")
        for column in ("what", "wall s", "GB/s", "vs memcpy", "CPU s", "CPU: memcpy's / this"):
            table.add_column(column, justify="left" if column == "what" else "right")
        for name, row in side["runs"].items():
            table.add_row(name, f"{row['wall_s']:.3f}", f"{row['gb_per_s']:.2f}",
                          _mark(row["vs_memcpy"], name != "memcpy", TARGETS["pull_shm"]), f"{row['cpu_s']:.3f}",
                          f"{row['cpu_vs_memcpy']:.2f}")
        console.print(table)
    for size in results["sizes"]:
        gb = size["bytes"] / 1e9
        if "memcpy" not in size:
            console.print(f"[yellow]{gb:.1f} GB skipped: {size['skipped'][0]['why']}[/]")
            continue
        memcpy = size["memcpy"]
        pooled = f"; pooled ({RING_TENSORS} buffers per rank and instance), not persisted" if size.get("pooled") else ""
        bound = size.get("copy_bound")
        bound_text = (f"; copy bound {bound['copy_bound_s']:.3f} s (D2H {bound['d2h_gb_per_s']:.1f} GB/s, memcpy "
                      f"{bound['memcpy_s']:.3f} s, H2D {bound['h2d_gb_per_s']:.1f} GB/s)") if bound else ""
        table = Table(title=f"Weight sync of a {gb:.2f} GB state dict: {size.get('table', 'synthetic')} ({size['tensors']} tensors, "
                            f"{size['chunk_mb']} MiB chunks{pooled}, {size.get('device', 'host')}); "
                            f"memcpy {memcpy['median_s']:.3f} s ({memcpy['gb_per_s']:.1f} GB/s, {memcpy['cpu_s']:.3f} CPU s)"
                            f"{bound_text}; load average "
                            f"{size['load_average_before']:.1f} -> {size['load_average_after']:.1f}")
        columns = ("transport", "verify", "ranks", "inst.", "push s", "visible s", "push GB/s", "visible vs memcpy", "pull s",
                   "pull vs memcpy", "pull CPU: memcpy's / pull's", "e2e s", "e2e / (memcpy+pull)", "rank extra MB (shard MB)",
                   "persist s")
        legs = bool(bound)
        twins = any("vs_synthetic" in c for c in size["cells"])
        columns += ("D2H s", "push to visible s", "H2D s", "e2e / copy bound") if legs else ()
        columns += ("push, pull vs synthetic",) if twins else ()
        for column in columns:
            table.add_column(column, justify="left" if column == "transport" else "right")
        for c in size["cells"]:
            shard = size.get("shard_bytes", {}).get(str(c["ranks"]), 0)
            extra = (f"{c['d2h_s']:.3f}", f"{c['push_to_visible_s']:.3f}", f"{c['h2d_s']:.3f}",
                     f"{c['end_to_end_vs_copy_bound']:.2f}") if legs else ()
            if twins:
                versus = c.get("vs_synthetic")
                extra += (f"{versus['push']:.2f}, {versus['pull']:.2f}" if versus else "-",)
            table.add_row(c["transport"], c["verify"], str(c["ranks"]), str(c["instances"]), f"{c['push_s']:.3f}",
                          f"{c['visible_s']:.3f}",
                          f"{c['push_gb_per_s']:.2f}", _mark(c["visible_vs_memcpy"], c["transport"] == "shm", TARGETS["push_visible_shm"]),
                          f"{c['pull_s']:.3f}", _mark(c["pull_vs_memcpy"], c["transport"] == "shm" and c["instances"] == 1,
                                                      TARGETS["pull_shm"]), f"{c['pull_cpu_vs_memcpy']:.2f}",
                          f"{c['end_to_end_s']:.3f}", _mark(c["end_to_end_vs_copy_plus_pull"], False, 0),
                          f"{c['rank_extra_bytes'] / 2**20:.0f} ({shard / 2**20:.0f})",
                          "off" if c["persist_s"] is None else f"{c['persist_s']:.2f}", *extra)
        console.print(table)
        for skipped in size["skipped"]:
            console.print(f"  [yellow]skipped ranks={skipped.get('ranks')} instances={skipped.get('instances')}: {skipped['why']}[/]")


def model_label(source: str) -> str:
    """A model's name in the tables: its directory's name (of config.json), else the file's stem."""
    path = Path(source)
    return path.name if path.is_dir() else (path.parent.name or path.stem) if path.name == "config.json" else path.stem


def _mark(value: float, has_target: bool, target: float) -> str:
    if not has_target:
        return f"{value:.2f}"
    return f"[green]{value:.2f}[/]" if value >= target else f"[red]{value:.2f}[/]"


if __name__ == "__main__":
    standalone = typer.Typer(add_completion=False)
    register(standalone)
    standalone(prog_name="staleflow bench params")
