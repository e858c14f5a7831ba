"""Where Task records come from: suites found by name (`suites`), task files (`task_file`), tasks
mined from a repository's history (`mine`, with the tests a diff touches: `touched_tests`), and tasks
synthesized from its code (`synth`: the bug families `bugs`, the traced baseline `probe`, the
problem statement `statement`)."""
