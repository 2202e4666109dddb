"""DSpine: parallel block drafts with adjacent causal injection for lossless speculative decoding.

``import dspine`` (and so any ``dspine.*`` or data tool import) loads neither torch nor transformers: ``DSpineConfig``
and ``DSpineDraftModel`` load their modules on first access. Each module registers its class with transformers when
it loads (``AutoConfig`` in dspine.config, ``AutoModel`` in dspine.model), so touch ``dspine.DSpineDraftModel`` (or
import dspine.model) before the Auto classes read a draft folder.
"""

__all__ = ["DSpineConfig", "DSpineDraftModel"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "DSpineConfig":
        from dspine.config import DSpineConfig

        return DSpineConfig
    if name == "DSpineDraftModel":
        from dspine.model import DSpineDraftModel

        return DSpineDraftModel
    raise AttributeError(f"module 'dspine' has no attribute {name!r}")
