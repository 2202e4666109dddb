"""DSpine: parallel block drafts with adjacent causal injection for lossless speculative decoding."""

from transformers import AutoConfig, AutoModel

from dspine.config import DSpineConfig
from dspine.model import DSpineDraftModel

AutoConfig.register("dspine", DSpineConfig, exist_ok=True)
AutoModel.register(DSpineConfig, DSpineDraftModel, exist_ok=True)

__all__ = ["DSpineConfig", "DSpineDraftModel"]
__version__ = "0.1.0"
