"""Training: tasks (graph + data), the loop, and data sources."""

from meshax.train.loop import TrainResult, train
from meshax.train.tasks import TASKS, LmTask, MlpTask, MnistTask, Seq2SeqTask, Task

__all__ = ["TASKS", "LmTask", "MlpTask", "MnistTask", "Seq2SeqTask", "Task", "TrainResult", "train"]
