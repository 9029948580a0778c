"""Running the model under Dynamo to find its graph breaks: the trace, the
sites and their categories, call chains, and ``explain``'s report; and
isolation, which keeps the user's streams and random state as they were."""
