-- Argo CD health of a tokenfleet TokenRoute, from the conditions the operator writes (docs/routing.md, "Model
-- routing"): Stalled (a target is missing, a route cycle, an invalid spec) is Degraded; Ready=True with nothing
-- left to do is Healthy; everything else, including an operator that has not yet seen the latest spec, is
-- Progressing.
local hs = {}
local by_type = {}
if obj.status ~= nil and obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    by_type[c.type] = c
  end
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
if by_type.Stalled ~= nil and by_type.Stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = says(by_type.Stalled)
  return hs
end
if by_type.Ready ~= nil and by_type.Ready.status == "True"
    and (by_type.Reconciling == nil or by_type.Reconciling.status ~= "True") then
  hs.status = "Healthy"
  hs.message = says(by_type.Ready)
  return hs
end
hs.status = "Progressing"
if by_type.Reconciling ~= nil and by_type.Reconciling.status == "True" then
  hs.message = says(by_type.Reconciling)
elseif by_type.Ready ~= nil then
  hs.message = says(by_type.Ready)
else
  hs.message = "Waiting for the operator to report Ready"
end
return hs
