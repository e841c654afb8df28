"""Datasets: the Dataset pair of iterator factories and the tokenizers (dew-core; the
tokenizers read published models' tokenizer.json too) and the Grain-backed readers
(dew-data), imported on first use."""

from __future__ import annotations

__path__ = __import__("pkgutil").extend_path(__path__, __name__)  # noqa: F821

from typing import TYPE_CHECKING

from dew._surface import surface

if TYPE_CHECKING:
    from dew.data.base import DataPartition as DataPartition
    from dew.data.base import Dataset as Dataset
    from dew.data.base import Reader as Reader
    from dew.data.base import Reporting as Reporting
    from dew.data.chat import Chat as Chat
    from dew.data.chat import ChatPreferences as ChatPreferences
    from dew.data.chat_template import ChatTemplate as ChatTemplate
    from dew.data.hf_text import HFText as HFText
    from dew.data.hf_tokenizer import HFTokenizer as HFTokenizer
    from dew.data.images import HFImages as HFImages
    from dew.data.mixture import Mixture as Mixture
    from dew.data.ramp import ramped as ramped
    from dew.data.stream import train_stream as train_stream
    from dew.data.token_windows import TokenWindows as TokenWindows
    from dew.data.tokenizers import ByteTokenizer as ByteTokenizer

__getattr__, __dir__, __all__ = surface(__name__, __file__, elsewhere="dew-data")
