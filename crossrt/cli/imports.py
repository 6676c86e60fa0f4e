"""`crossrt import`: another runtime's speculative decoding statistics as a run record."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from crossrt.cli.common import refuse_inputs_as_outputs, user_errors
from crossrt.inputs.pairs import resolve_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.imports.logs import ReadOptions
from crossrt.imports.imported import MAX_K
from crossrt.imports.importer import AGGREGATE, FORMATS, ImportRequest, import_record, import_summary
from crossrt.run.runtime import SPEC_TYPES
from crossrt.records.record_json import save_record
from crossrt.records.tables import render, summary_table


@click.command("import")
@user_errors
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--from", "source", type=click.Choice(list(FORMATS)), required=True,
              help="The text's format (below).")
@click.option("--before", type=click.Path(path_type=Path, dir_okay=False),
              help="vllm-metrics, sglang-metrics, llama-server-metrics: an earlier scrape of the same endpoint; "
              "the record holds FILE minus BEFORE (scrape before and after a benchmark).")
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False),
              help="Record to write. Default: runs/imported/<FILE name>.json")
@click.option("--overwrite", is_flag=True, help="Replace the record at --out.")
@click.option("--k", type=click.IntRange(1, MAX_K),
              help="Draft tokens per step, where the text does not show it (vLLM and llama.cpp print one rate "
              "per position when they print rates; exllamav3's rounds show their windows). SGLang: its "
              "--speculative-num-draft-tokens minus 1 (that count includes the root token).")
@click.option("--decode-log-interval", type=click.IntRange(min=1), default=40, show_default=True,
              help="sglang-log: the server's --decode-log-interval, decode passes per logged window.")
@click.option("--pair", help="Pair manifest (path, or name under models/pairs) of the files the runtime ran, to "
              "record their digests; the files must be here. Without it the record names no files.")
@click.option("--pair-name", help="Name of the pair in the record when --pair is not given.")
@click.option("--category", default=AGGREGATE, show_default=True,
              help="Category of the one aggregate result, e.g. code when every prompt was code.")
@click.option("--spec-type", type=click.Choice(SPEC_TYPES), help="The drafting method, in crossrt's names.")
@click.option("--greedy/--sampled", default=None, help="Whether the run decoded greedily (texts do not say it).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), help="Token budget per request, if known.")
@click.option("--n-ctx", type=click.IntRange(min=1), help="Context size, if known.")
@click.option("--draft-n-min", type=click.IntRange(min=0), help="llama.cpp's --spec-draft-n-min, if known.")
@click.option("--draft-p-min", type=click.FloatRange(0, 1), help="llama.cpp's --spec-draft-p-min, if known.")
@click.option("--prompts", "prompt_source", help="aiperf per-request export: the prompts its requests ran (a "
              "prompts file, as run's --prompts), to name each request's result as that prompt, so that parity "
              "compares it with a crossrt record of the same prompts prompt by prompt. Matched by text through "
              "--inputs, else by position.")
@click.option("--inputs", type=click.Path(path_type=Path, dir_okay=False),
              help="aiperf: AIPerf's inputs.json (each request's payload, by conversation and turn), to match the "
              "requests to --prompts by their text. Default: inputs.json beside FILE, where there is one.")
def import_command(file: Path, source: str, before: Optional[Path], out: Optional[Path], overwrite: bool,
                   k: Optional[int], decode_log_interval: int, pair: Optional[str], pair_name: Optional[str],
                   category: str, spec_type: Optional[str], greedy: Optional[bool], max_new_tokens: Optional[int],
                   n_ctx: Optional[int], draft_n_min: Optional[int], draft_p_min: Optional[float],
                   prompt_source: Optional[str], inputs: Optional[Path]) -> None:
    """Read a runtime's own speculative decoding statistics into a run record that `show`,
    `report`, `parity` and `reproduce` read beside crossrt's runs. Its one aggregate result
    (one per request from AIPerf's per-request export) holds counters only: no token ids (no
    lossless check), no timings; the record says what its source gives (docs/import.md).

    \b
    vllm-log              vLLM V1 log: every 'SpecDecoding metrics:' line, summed
    vllm-metrics          vLLM /metrics (vllm:spec_decode_*, all engines), or the counters
                          vLLM's examples/offline_inference/spec_decode.py prints
    sglang-log            SGLang server log: 'Decode batch ... accept len' windows
    sglang-metrics        SGLang /metrics (sglang:spec_verify_calls_total, generation_tokens_total;
                          give --k), or responses' meta_info (spec_verify_ct, ...) as JSON
    llama-server-metrics  llama-server --metrics /metrics (llamacpp:spec_decode_*)
    llama-server-log      llama-server log: each request's 'draft acceptance' line
    exllamav3-stats       exllamav3 job.draft_stats rounds as JSON (eval/spec_decode.py
                          -dstats/--draft_stats FILE, or json.dump(job.draft_stats))
    aiperf                NVIDIA AIPerf's profile_export.jsonl (one prompt per request;
                          --prompts names them), profile_export_aiperf.json (give --k) or
                          server_metrics_export.json; vLLM's counting

    \b
    crossrt import server.log --from vllm-log
    crossrt import after.prom --before before.prom --from vllm-metrics
    crossrt import artifacts/run/profile_export.jsonl --from aiperf --prompts prompts.jsonl
    crossrt show runs/imported/server.log.json runs/tiny-llama-cpp-k4.json

    Counts are recovered from a log's rounded rates only where exactly one count fits
    them; otherwise the command says so and names the counter endpoint to read instead.
    """
    prompts = tuple(load_prompts(prompt_source)) if prompt_source is not None else None
    request = ImportRequest(file, source, before, ReadOptions(k, decode_log_interval),
                            resolve_pair(pair) if pair else None, pair_name, category, spec_type, greedy,
                            max_new_tokens, n_ctx, draft_n_min, draft_p_min, prompts, inputs)
    record = import_record(request)
    out = out or Path("runs") / "imported" / f"{file.name}.json"
    refuse_inputs_as_outputs({"--out": out}, [file, *([before] if before else []), *([inputs] if inputs else [])])
    if out.exists() and not overwrite:
        raise click.UsageError(f"{out} exists: pass --overwrite to replace it, or --out")
    save_record(record, out)
    click.echo(render(summary_table([(out, record)]), "table"))
    click.echo(import_summary(record))
    click.echo(f"record: {out}")
