"""A stand-in for Hugging Face ``datasets`` on the offline GPU machine, for torchtitan 0.2.2 only (bench/peers/run.sh
puts this folder on its PYTHONPATH): torchtitan's trainer imports ``torchtitan.hf_datasets.text_datasets``, which
imports ``Dataset`` and ``load_dataset`` at module level, whether or not it loads any. The rows feed torchtitan
lmtrain's prepared tokens (bench/peers/titan_configs.py), so nothing here is ever called; installing ``datasets``
and its dependencies (pyarrow, pandas, fsspec, ...) for an import would carry some 100 MB more."""


class Dataset:
    """Never built in the rows (torchtitan names the class only in annotations)."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("bench/peers/titan_shim stands in for Hugging Face datasets: install datasets to load one")


def load_dataset(*args, **kwargs):
    raise RuntimeError("bench/peers/titan_shim stands in for Hugging Face datasets: install datasets to load one")
