"""Rewrite the README's results section, between `<!-- bench:start -->` and
`<!-- bench:end -->`, from results/*.md (benchmarks in a fixed order, then any others).

    python scripts/update_readme_results.py [--readme README.md] [--results results]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
ORDER = ("bench_real_model", "bench_throughput_vs_hf", "bench_throughput_vs_hf_large_batch",
         "bench_prefix_caching",
         "bench_chunked_prefill", "bench_mixed_batching", "bench_spec_decode",
         "bench_embeddings", "bench_health_under_load",
         "bench_host_overhead",
         "bench_decode_roofline",
         "bench_compile_check", "bench_startup", "bench_startup_targets")


def results_section(results: Path) -> str:
    files = {p.stem: p for p in sorted(results.glob("*.md"))}
    names = [n for n in ORDER if n in files] + [n for n in files if n not in ORDER]
    parts = [files[n].read_text().strip() for n in names]
    header = ("Made by `scripts/bench_all.sh` (each benchmark also runs alone: the command is "
              "under its title). Regenerate with `python scripts/update_readme_results.py`.")
    return "\n\n".join([header, *parts])


def replace_between_markers(text: str, body: str) -> str:
    start, end = text.find(START), text.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"README: markers {START} ... {END} not found in that order")
    return text[:start + len(START)] + "\n" + body.strip() + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parent.parent
    p.add_argument("--readme", default=str(root / "README.md"))
    p.add_argument("--results", default=str(root / "results"))
    args = p.parse_args(argv)
    readme = Path(args.readme)
    try:
        text = replace_between_markers(readme.read_text(), results_section(Path(args.results)))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    readme.write_text(text)
    print(f"updated {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
