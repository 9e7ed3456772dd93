"""Training: tasks (graph + data), the loop, and data sources."""

from meshax.train.loop import TrainResult, train
from meshax.train.tasks import TASKS, CnnTask, LmTask, MlpTask, MnistTask, Seq2SeqTask, Task, UNetTask

__all__ = [
    "TASKS",
    "CnnTask",
    "LmTask",
    "MlpTask",
    "MnistTask",
    "Seq2SeqTask",
    "Task",
    "TrainResult",
    "UNetTask",
    "train",
]
