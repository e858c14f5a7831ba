"""Grading an episode: the reward checker (`checker`, reading JUnit reports with `junit`), checks
graded by values in a judge sandbox (`isolated`, `programs`), the reward-hack monitor
(`hack_monitor`), and the behaviour statistics of episodes (`behaviour`)."""
