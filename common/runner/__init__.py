"""What one rank runs: its model and KV cache (`load_rank`), and a step's forward pass
from plain-int inputs (`ModelRunner.forward(StepInputs)`).

Below both the engine (common/engine/: scheduling, and StepRunner, which plans a
scheduled step into StepInputs on rank 0) and tensor parallelism (common/parallel/: the
worker ranks that receive those inputs and run the same forward pass); neither imports
the other's package for it.
"""
