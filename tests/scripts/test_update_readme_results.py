"""scripts/update_readme_results.py replaces exactly what is between the bench markers."""

from __future__ import annotations

import update_readme_results as upd


def test_results_replace_only_the_marked_section(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "bench_prefix_caching.md").write_text("### Prefix caching\n\n| a |\n")
    (results / "bench_throughput_vs_hf.md").write_text("### Throughput\n\n| b |\n")
    (results / "bench_zzz_other.md").write_text("### Other\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\nintro\n{upd.START}\nold table\n{upd.END}\nfooter\n")

    assert upd.main(["--readme", str(readme), "--results", str(results)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\nintro\n" + upd.START) and text.endswith(upd.END + "\nfooter\n")
    assert "old table" not in text
    # fixed order first (throughput, then prefix caching), then the rest
    assert text.index("### Throughput") < text.index("### Prefix caching") < text.index("### Other")

    assert upd.main(["--readme", str(readme), "--results", str(results)]) == 0
    assert readme.read_text() == text  # idempotent


def test_missing_markers_are_an_error_and_leave_the_readme_alone(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    assert upd.main(["--readme", str(readme), "--results", str(tmp_path)]) == 2
    assert "markers" in capsys.readouterr().err
    assert readme.read_text() == "# no markers\n"
