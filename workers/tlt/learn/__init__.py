"""What trains: the GRPO learner, the drafter's loss, warm-up and buffer, the tiny model's SFT."""
