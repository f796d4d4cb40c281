"""The dataset mixture's check (``dataset_mixture``, alignment-handbook's shape): its keys, its sets' ids, weights and
columns, the local files an id names. ``toolkit.config``'s ``DataArguments`` parses the field and calls it; the
mixing itself is ``toolkit.data.mixture``'s.

Standard library only: nothing is read but the file system's names.
"""

from __future__ import annotations

import glob
import os

from toolkit.config.checks import DATA_EXTENSIONS
from toolkit.errors import ConfigError

MIXTURE_KEYS = ("datasets", "seed", "test_split_size")
MIXTURE_SET_KEYS = ("id", "config", "split", "columns", "weight")


def _check_mixture(mixture: dict) -> dict:
    """alignment-handbook's ``dataset_mixture``, checked, with its defaults filled in (seed 0, split train, weight
    1, all columns, no test split); local ids (a path or a glob) must name files."""
    _known_keys(mixture, MIXTURE_KEYS, "")
    sets = mixture.get("datasets")
    if not isinstance(sets, list) or not sets:
        raise ConfigError("dataset_mixture", "needs datasets: a list of {id, split, columns, weight}")
    out = []
    for i, entry in enumerate(sets):
        where = f"datasets[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
            raise ConfigError("dataset_mixture", f"{where} needs an id (a file, a glob or a Hub dataset name)")
        _known_keys(entry, MIXTURE_SET_KEYS, f"{where} ")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1:
            raise ConfigError("dataset_mixture", f"{where} ({entry['id']}): weight is the fraction of the set's rows "
                                                 f"to take, in (0, 1]; got {weight!r}")
        columns = entry.get("columns")
        if columns is not None and (not isinstance(columns, list) or not all(isinstance(c, str) for c in columns)):
            raise ConfigError("dataset_mixture", f"{where} ({entry['id']}): columns must be a list of column names")
        mixture_files(entry["id"], where)
        out.append({"id": entry["id"], "config": entry.get("config"), "split": str(entry.get("split") or "train"),
                    "columns": columns, "weight": float(weight)})
    seed, test = mixture.get("seed", 0), mixture.get("test_split_size")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError("dataset_mixture", f"seed must be an integer, got {seed!r}")
    if test is not None and (isinstance(test, bool) or not isinstance(test, (int, float)) or not 0 <= test < 1):
        raise ConfigError("dataset_mixture", f"test_split_size is the fraction held out, in [0, 1); got {test!r}")
    return {"datasets": out, "seed": seed, "test_split_size": test}


def _known_keys(mapping: dict, known: tuple, where: str) -> None:
    unknown = [k for k in mapping if k not in known]
    if unknown:
        raise ConfigError("dataset_mixture", f"{where}has unknown key(s) {unknown}; known: {', '.join(known)}")


def mixture_files(dataset_id: str, where: str = "dataset_mixture") -> list[str] | None:
    """The local files a mixture id names (a path or a glob, as train_file's), or None for a Hub (or built-in) name:
    an id with a data file's extension, a path separator or a glob pattern is local."""
    local = glob.has_magic(dataset_id) or os.path.splitext(dataset_id)[1].lower() in DATA_EXTENSIONS or \
        os.path.exists(dataset_id)
    if not local:
        return None
    files = sorted(p for p in glob.glob(dataset_id, recursive=True) if os.path.isfile(p))
    if not files:
        raise ConfigError("dataset_mixture", f"{where}: no file matches {dataset_id!r}")
    for path in files:
        if os.path.splitext(path)[1].lower() not in DATA_EXTENSIONS:
            raise ConfigError("dataset_mixture", f"{where}: unsupported extension ({path}); use one of "
                                                 f"{', '.join(DATA_EXTENSIONS)}")
    return files
