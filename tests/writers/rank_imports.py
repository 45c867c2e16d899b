"""What every writer's ranks import, imported once by the fork server they are forked from
(spawn.py). transformers' generation would import scikit-learn for assisted decoding, which
no save uses (a second a rank): it is taken for absent, as the watcher's workers take it."""

import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import transformers.utils

transformers.utils.is_sklearn_available = lambda: False

import transformers.models.llama.modeling_llama  # noqa: E402, F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402, F401
