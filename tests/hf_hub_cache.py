"""Write a Hugging Face `datasets` cache exactly as `load_dataset("<org>/<name>", "<config>")` leaves it.

A Hub dataset stored as parquet is prepared by `datasets`' Parquet builder, configured from the repo's
metadata configs, into ``<cache>/<org>___<name>/<config>/0.0.0/<commit>/`` (`<name>-<split>.arrow` and
`dataset_info.json`). Tests download nothing, so the fixture runs that same builder on local
parquet files: the cache it writes is the one an offline `load_dataset` later finds, layout and all.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the Hub revision: any 40 hex digits


def write_hub_cache(cache_dir: Path, repo_id: str, config: str, splits: dict[str, dict[str, list]]) -> Path:
    """Cache ``splits`` (split -> column -> values) as the Hub dataset ``repo_id``'s ``config``."""
    from datasets.data_files import DataFilesDict
    from datasets.load import configure_builder_class
    from datasets.packaged_modules.parquet.parquet import Parquet, ParquetConfig

    source = Path(cache_dir).parent / f"{repo_id.replace('/', '__')}-{config}-parquet"
    source.mkdir(parents=True, exist_ok=True)
    for split, columns in splits.items():
        pq.write_table(pa.table(columns), source / f"{split}.parquet")
    files = DataFilesDict.from_patterns({split: [str(source / f"{split}.parquet")] for split in splits})
    name = repo_id.split("/")[-1]
    builder_class = configure_builder_class(
        Parquet,
        builder_configs=[ParquetConfig(name=config, data_files=files)],
        default_config_name=None,
        dataset_name=name,
    )
    builder = builder_class(
        cache_dir=str(cache_dir), dataset_name=name, config_name=config, repo_id=repo_id, hash=COMMIT
    )
    builder.download_and_prepare()
    folder = Path(cache_dir) / repo_id.replace("/", "___") / config / "0.0.0" / COMMIT
    assert (folder / "dataset_info.json").is_file(), f"datasets wrote its cache elsewhere than {folder}"
    return folder
