"""Export of trained policies: Hugging Face folders (merged or full) and PEFT adapter folders."""
