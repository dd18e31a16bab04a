"""vLLM's `download_dir`: a model named by its hub id, found in a local cache directory laid out
as the Hugging Face hub lays one out (`models--ORG--NAME/snapshots/REV`), or as a plain
`DIR/ORG/NAME` copy. Nothing is fetched: a model not there is an error."""

from __future__ import annotations

from pathlib import Path


def local_model_path(field: str, model: str, download_dir: str | None) -> str:
    """`model` itself where it is a local path (or no download_dir is given); else its copy in
    `download_dir`. `field` names the argument in errors (model, tokenizer)."""
    if download_dir is None or Path(model).exists():
        return model
    root = Path(download_dir)
    if not root.is_dir():
        raise ValueError(f"download_dir: {download_dir} is not a directory")
    repo = root / ("models--" + model.replace("/", "--"))
    ref = repo / "refs" / "main"
    snapshots = ([repo / "snapshots" / ref.read_text().strip()] if ref.is_file()
                 else sorted((repo / "snapshots").glob("*")))
    if len(snapshots) == 1 and snapshots[0].is_dir():
        return str(snapshots[0])
    if len(snapshots) > 1:
        raise ValueError(f"{field}: {repo / 'snapshots'} holds {len(snapshots)} revisions and "
                         f"no refs/main; pass the one to serve as a path")
    if (root / model).exists():
        return str(root / model)
    raise ValueError(f"{field}: {model!r} is not a local path, nor in download_dir "
                     f"{download_dir} (as {repo.name}/snapshots/* or {model}); jaxserve fetches "
                     f"nothing")
