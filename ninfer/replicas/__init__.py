"""Engine replicas behind one frontend and a router that scores by exact restore points
(issue 34): ``summary`` (what a replica publishes, what the router keeps), ``router`` (the
scoring rule and the routing state), ``frontend`` (the Ray actor that runs N engines)."""
