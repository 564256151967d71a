"""Checkpointed batch inference on a gang: each member computes its shard round by round, the leader
commits every round once all members staged it, and a restarted gang resumes after the latest commit."""
