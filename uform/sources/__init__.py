"""Training data from files, shards and iterables: readers, the record convention, steps filled to capacity and
an exactly resumable order (issue 13). Host-side: nothing here imports torch.

    source = open_source("shards/{000..009}.tar", fields={"jpg": "image", "txt": "text"})
    loader = Loader(source, config)
    trainer.step(*loader.next_step())
    state = loader.state()  # JSON-able; Loader.resume(source, config, state) continues exactly there
"""

from .fields import Fields
from .loader import Loader, merge_states
from .source import Source, open_source
from .step_input import StepInput

__all__ = ["Fields", "Loader", "Source", "StepInput", "merge_states", "open_source"]
