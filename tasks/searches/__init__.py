"""The search kinds of the search stage (tasks/text_search.py, prompt.search): how a round looks
for a better text for the policy.

    prompt_agent.py  prompt_agent: a tree of prompts revised from their errors (PromptAgent)
    beliefs.py       beliefs: each role's beliefs, from its better episodes against its worse (FinCon)
"""
