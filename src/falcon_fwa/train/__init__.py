"""Language-model training: recipes, the loop, checkpoints, DDP/FSDP2 through torchrun."""
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import RunConfig, config_from_dict, load_config
from .schedule import lr_at
from .trainer import NonFiniteLoss, Trainer

__all__ = ["RunConfig", "load_config", "config_from_dict", "Trainer", "NonFiniteLoss", "save_checkpoint",
           "load_checkpoint", "latest_checkpoint", "lr_at"]
