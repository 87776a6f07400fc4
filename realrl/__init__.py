"""realrl: reinforcement-learning fine-tuning of language models as a dataflow graph of model
function calls (MFCs), from one laptop CPU to a SLURM cluster."""

__version__ = "0.1.0"
