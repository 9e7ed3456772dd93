"""Training: tasks (graph + data), the loop, and data sources."""

from meshax.train.loop import TrainResult, train
from meshax.train.tasks import TASKS, MlpTask, MnistTask, Task

__all__ = ["TASKS", "MlpTask", "MnistTask", "Task", "TrainResult", "train"]
