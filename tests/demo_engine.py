"""A concrete do-nothing engine module's source, for the discovery tests' fake distributions."""

_DEMO_ENGINE = '''
from dataclasses import dataclass
from wtransfer.engines import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

{prefix}

@dataclass
class Init(WeightTransferInitInfo):
    pass

@dataclass
class Update(WeightTransferUpdateInfo):
    pass

class {cls}(WeightTransferEngine):
    """Test engine {cls}: a complete engine class that moves nothing."""
    init_info_cls = Init
    update_info_cls = Update
    def init_transfer_engine(self, init_info): pass
    def receive_weights(self, update_info, load_weights): pass
    def shutdown(self): pass
'''


def demo_engine_module(cls: str = "DemoEngine", prefix: str = "") -> str:
    """Source of a module defining a concrete do-nothing engine class ``cls``, for discovery tests; ``prefix`` is
    module-level code run at import (a line that raises, say)."""
    return _DEMO_ENGINE.format(cls=cls, prefix=prefix)
