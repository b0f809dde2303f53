"""Answer checks, one module per kind. Each kind is a config model (a member of
`ratchet.data.checkers.CheckConfig`) that carries its own behaviour and declarations as a
`Check`: reading an answer, judging a response against the reference, a graded value for a
tree search. Registration is one line in data/checkers.py.
"""
