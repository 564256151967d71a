-- Argo CD health of a tokenfleet InferenceService, from the conditions the operator writes (docs/api.md):
-- Stalled (a replica spent its restart budget, or the spec is invalid) and Degraded with a replica failing or
-- restarting are Degraded; Ready=True with nothing left to do is Healthy; everything else, including an
-- operator that has not yet seen the latest spec, is Progressing.
local hs = {}
local function conditions(o)
  local by_type = {}
  if o.status ~= nil and o.status.conditions ~= nil then
    for _, c in ipairs(o.status.conditions) do
      by_type[c.type] = c
    end
  end
  return by_type
end
local function says(c)
  if c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return c.reason
end

if obj.status == nil or obj.status.observedGeneration == nil
    or (obj.metadata.generation ~= nil and obj.status.observedGeneration ~= obj.metadata.generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe the latest spec"
  return hs
end
local c = conditions(obj)
if c.Stalled ~= nil and c.Stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = says(c.Stalled)
  return hs
end
if c.Degraded ~= nil and c.Degraded.status == "True"
    and (c.Degraded.reason == "SliceFailed" or c.Degraded.reason == "SliceUnhealthy") then
  hs.status = "Degraded"
  hs.message = says(c.Degraded)
  return hs
end
if c.Ready ~= nil and c.Ready.status == "True"
    and (c.Reconciling == nil or c.Reconciling.status ~= "True") then
  hs.status = "Healthy"
  hs.message = says(c.Ready)
  return hs
end
hs.status = "Progressing"
if c.Reconciling ~= nil and c.Reconciling.status == "True" then
  hs.message = says(c.Reconciling)
elseif c.Ready ~= nil then
  hs.message = says(c.Ready)
else
  hs.message = "Waiting for the operator to report Ready"
end
return hs
