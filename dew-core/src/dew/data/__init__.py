"""Datasets: the Dataset pair of iterator factories (dew-core) and the
tokenizers and Grain-backed readers (dew-data), resolved on first use."""

__path__ = __import__("pkgutil").extend_path(__path__, __name__)  # noqa: F821

from dew._lazy import Export, exporter

_DATA = "dew-data"
_EXPORTS = {
    "Dataset": Export("dew.data.base"),
    "DataPartition": Export("dew.data.base"),
    "Reader": Export("dew.data.base"),
    "ByteTokenizer": Export("dew.data.tokenizers", _DATA),
    "HFTokenizer": Export("dew.data.hf_tokenizer", _DATA, "hf"),
    "TokenWindows": Export("dew.data.token_windows", _DATA),
    "HFImages": Export("dew.data.images", _DATA, "hf"),
    "train_stream": Export("dew.data.stream", _DATA),
    "ramped": Export("dew.data.ramp", _DATA),
}

__getattr__, __dir__ = exporter(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
