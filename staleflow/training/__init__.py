"""Trainers behind one interface: a simulated step-time model and an FSDP2 GRPO/DAPO trainer."""
